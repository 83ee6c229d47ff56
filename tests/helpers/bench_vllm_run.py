"""One run of benchmarks/vllm/bench_vllm.py on vLLM's CPU build per test process, shared by the
offline and the serving smoke tests: the serving one starts its servers where this run
keeps its compiles (the same engine arguments, so the same compile cache key)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm"
ROOT = BENCH.parents[1]
# The vLLM benchmarks' modules, and the ones the benchmarks share (bench_common.py).
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import bench_vllm  # noqa: E402


def require_cpu_build() -> None:
    """Skip unless vLLM's CPU build is importable (on a GPU, scripts/gpu_vllm.sh runs the
    benchmarks)."""
    import pytest

    pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")
    from fusion_pass.tools.demo import on_cpu

    if not on_cpu():
        pytest.skip("the CPU build's test (on a GPU, scripts/gpu_vllm.sh runs the benchmark)")


BATCHES = [1, 3]
STEPS = 3
PREFILL = 64
# Engine flags both benchmarks take (their CPU defaults otherwise), the same in both runs.
# The A/A pair is the plugin's (two compiles of the fused graphs); the serving run measures
# the plugin's two engines only (each server starts a vLLM of its own: minutes on 2 cores).
ENGINE = ["--tp", "2", "--models", "tiny", "--aa", "plugin"]
OFFLINE = [*ENGINE, "--variants", "off", "in_tree", "plugin", "--batches", *map(str, BATCHES),
           "--decode-steps", str(STEPS), "--input-len", "8", "--prefill-len", str(PREFILL),
           "--repeats", "2", "--max-repeats", "2", "--warmup", "0", "--check", "all",
           "--keep-caches"]


WARMED: dict[str, tuple[int, int]] = {}
"""The shared model-class answers as the warm-up wrote them: file name -> (inode, mtime)."""


@functools.cache
def offline() -> tuple[int, dict[str, Any], Path]:
    """(exit code, results, work folder with the engines' caches) of the shared run."""
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-cpu-"))
    atexit.register(shutil.rmtree, root, True)
    # vLLM's model-class answer written once, as the GPU run does before its engines start.
    info = root / "work" / "modelinfos"
    subprocess.run([sys.executable, str(BENCH / "vllm_setup.py"), "warm-model-info", str(info)],
                   check=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    WARMED.update({p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in info.iterdir()})
    # A job the measurements wait for (as the GPU run's end-to-end check): ends before the
    # engines are up.
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        rc = bench_vllm.main([*OFFLINE, "--after-pid", str(job.pid), "--work-dir",
                              str(root / "work"), "--out-dir", str(root), "--name", "r.json"])
    finally:
        job.kill()
        job.wait()
    return rc, json.loads((root / "r.json").read_text()), root / "work"


def only_model(result: dict[str, Any]) -> dict[str, Any]:
    """The results of the one model a smoke run measures."""
    [m] = result["models"]
    return m

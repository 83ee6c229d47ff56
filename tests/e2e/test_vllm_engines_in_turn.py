"""vLLM engines one after another in the same rank processes (vLLM's CPU build, TP=2).

Two ranks launched by torchrun run three ``LLM``\\ s in turn with
``distributed_executor_backend="external_launcher"`` (one engine per rank, in
the rank's own process), vLLM's ``cleanup_dist_env_and_memory()`` between
them: the plugin's engine (``fusion_pass.vllm_integration.compilation_config()``),
the plugin's engine again, and one without the plugin.  Each engine's
tensor-parallel group comes back under the name the first one had.  Both
plugin engines fuse every all-reduce -> RMSNorm site (counted from the model:
``demo.ModelSpec.sites()``) on both ranks and generate the tokens of the engine
without the plugin; each engine's group is a new
:class:`fusion_pass.groups.Group`, and the earlier engines' have ended.

Each engine gets a rendezvous of its own (``MASTER_PORT`` set anew, torchrun's
agent store not used): the default group comes back under the same name, and in
torchrun's store, which keeps the first engine's keys under those names, its
gloo mesh would connect to the first engine's closed ports.

Run by pytest, this module starts torchrun on itself; each rank runs
:func:`main`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINES = (True, True, False)
"""With the plugin or not, in turn."""
SPEC_ARGS = dict(name="tiny-llama", hidden=256, layers=2)
DTYPE = "float32"


def main(model: str, out: str, ports: str) -> None:
    """One rank: the engines of :data:`ENGINES` in turn, each one's record written
    to ``out.<rank>``."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher needs it
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # a store of its own per engine
    from vllm import LLM, SamplingParams
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from fusion_pass import groups, records
    from fusion_pass.tools import demo
    from fusion_pass.vllm_integration import compilation_config

    rank = int(os.environ["RANK"])
    earlier: list = []
    result = []
    for engine, (plugin, port) in enumerate(zip(ENGINES, ports.split(","))):
        os.environ["MASTER_PORT"] = port
        start = len(records.HISTORY)
        llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                  dtype=DTYPE, skip_tokenizer_init=True, max_model_len=128,
                  max_num_batched_tokens=128, max_num_seqs=4, seed=0,
                  compilation_config=compilation_config() if plugin else {})
        outs = llm.generate([{"prompt_token_ids": p} for p in demo.PROMPTS],
                            SamplingParams(max_tokens=demo.MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True), use_tqdm=False)
        name = ps.get_tp_group().device_group.group_name
        group = groups.group(name)
        result.append({
            "plugin": plugin, "tp_group": name, "size": group.size,
            "ids": [list(o.outputs[0].token_ids) for o in outs],
            "sites": [(str(getattr(s.path, "value", s.path)), s.reason)
                      for g in records.HISTORY[start:] for s in g.sites],
            "earlier_ended": [g.ended for g in earlier]})
        earlier.append(group)
        del llm, outs
        cleanup_dist_env_and_memory()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> list[list[dict]]:
    pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")
    from fusion_pass.testing.spawn import free_port
    from fusion_pass.tools import demo

    work = tmp_path_factory.mktemp("engines")
    model = demo.make_checkpoint(demo.ModelSpec(**SPEC_ARGS), work / "ckpt", dtype=DTYPE)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1",
               TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
               VLLM_CACHE_ROOT=str(work / "vllm-cache"),
               TORCHINDUCTOR_CACHE_DIR=str(work / "inductor-cache"))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", demo.cpu_env()["VLLM_CPU_OMP_THREADS_BIND"])
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    ports = ",".join(str(free_port()) for _ in ENGINES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", __file__, str(model), str(work / "out"), ports]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-8000:])
    return [json.loads((work / f"out.{r}").read_text()) for r in range(2)]


def test_every_engine_runs_on_a_new_group_under_the_same_name(engines):
    for ranks in engines:
        assert [e["plugin"] for e in ranks] == list(ENGINES)
        assert len({e["tp_group"] for e in ranks}) == 1, [e["tp_group"] for e in ranks]
        assert all(e["size"] == 2 for e in ranks)
        assert [e["earlier_ended"] for e in ranks] == [[True] * i for i in range(len(ENGINES))]


def test_both_plugin_engines_fuse_every_site(engines):
    from fusion_pass.tools import demo

    sites = demo.ModelSpec(**SPEC_ARGS).sites()
    for rank, ranks in enumerate(engines):
        for e in ranks:
            if e["plugin"]:
                assert len(e["sites"]) == sites, (rank, e["sites"])
                assert all(path != "unfused" for path, _ in e["sites"]), (rank, e["sites"])
            else:
                assert e["sites"] == []


def test_plugin_engines_generate_the_tokens_of_the_engine_without_it(engines):
    from fusion_pass.tools import demo

    for ranks in engines:
        unfused = [e["ids"] for e in ranks if not e["plugin"]][0]
        assert len(unfused) == len(demo.PROMPTS)
        assert all(len(ids) == demo.MAX_TOKENS for ids in unfused)
        assert all(e["ids"] == unfused for e in ranks)
    assert [e["ids"] for e in engines[0]] == [e["ids"] for e in engines[1]]


if __name__ == "__main__":
    main(*sys.argv[1:4])

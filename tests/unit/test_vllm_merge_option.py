"""``merge_summed_all_reduces`` from vLLM: both ways of enabling the plugin bring it to the pass
(the Python ``compilation_config`` and the ``vllm serve`` JSON, which names a second published
pass), it keys vLLM's compile cache, survives the copies vLLM makes, is off by default, and
changes what the pass does to a graph of two summed all-reduces."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_text import calls

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fusion_pass.vllm_integration import (VllmAllReduceRMSNormPass, cli_json,  # noqa: E402
                                          compilation_config, plugin)

FUSED = "fusion_pass.allreduce_rmsnorm.default"
ALL_REDUCE = "_c10d_functional.all_reduce"
HIDDEN = 64


def _pass(cfg: dict) -> VllmAllReduceRMSNormPass:
    return cfg["inductor_compile_config"]["post_grad_custom_post_pass"]


def test_off_by_default_in_both_forms() -> None:
    assert VllmAllReduceRMSNormPass().merge_summed_all_reduces is False
    assert _pass(compilation_config()).merge_summed_all_reduces is False
    named = json.loads(cli_json())["inductor_passes"]["post_grad_custom_post_pass"]
    assert named == f"fusion_pass.{plugin.JSON_NAME}"


def test_python_form_reaches_the_pass_keys_the_cache_and_survives_copies() -> None:
    off, on = _pass(compilation_config()), _pass(compilation_config(merge_summed_all_reduces=True))
    assert on.merge_summed_all_reduces is True
    assert on.uuid() != off.uuid()
    # vLLM deep-copies its config and pickles it to the engine core and the workers.
    for moved in (pickle.loads(pickle.dumps(on)), copy.deepcopy(on), copy.copy(on)):
        assert moved.merge_summed_all_reduces is True and moved.uuid() == on.uuid()


def test_json_form_names_the_merging_pass() -> None:
    given = json.loads(cli_json(merge_summed_all_reduces=True, base={"mode": 3}))
    assert given["inductor_passes"] == {
        "post_grad_custom_post_pass": f"fusion_pass.{plugin.JSON_MERGE_NAME}"}
    assert given["mode"] == 3 and given["pass_config"] == {"fuse_allreduce_rms": False}
    assert plugin.JSON_MERGE_NAME != plugin.JSON_NAME


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_a_value_that_is_not_a_bool_is_refused(bad) -> None:
    with pytest.raises(TypeError, match="merge_summed_all_reduces must be True or False"):
        compilation_config(merge_summed_all_reduces=bad)
    with pytest.raises(TypeError, match="merge_summed_all_reduces must be True or False"):
        cli_json(merge_summed_all_reduces=bad)


# vLLM's own plugin loader and config classes, in a fresh process (loading plugins changes
# process-wide state): each form becomes a config whose prepared pass holds the option.
PROBE = r"""
import json, pickle
from vllm.plugins import load_general_plugins

load_general_plugins()

from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
from fusion_pass.vllm_integration import cli_json, compilation_config

def prepared(cc):
    vc = VllmConfig(compilation_config=CompilationConfig(**cc),
                    parallel_config=ParallelConfig(tensor_parallel_size=2))
    p = vc.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]
    moved = pickle.loads(pickle.dumps(p))  # as the config travels to the workers
    return dict(type=type(p).__name__, merge=p.merge_summed_all_reduces, uuid=p.uuid(),
                moved=[moved.merge_summed_all_reduces, moved.uuid() == p.uuid()],
                inactive=p.inactive_reason)

out = {}
for merge in (False, True):
    out[f"json {merge}"] = prepared(json.loads(cli_json(merge_summed_all_reduces=merge)))
    out[f"python {merge}"] = prepared(compilation_config(merge_summed_all_reduces=merge))
print("RESULT " + json.dumps(out))
"""


def test_both_forms_reach_the_pass_through_vllms_loader_and_configs() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ))
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, (r.stdout + r.stderr)[-6000:]
    res = json.loads(line[len("RESULT "):])
    for form in ("json", "python"):
        off, on = res[f"{form} False"], res[f"{form} True"]
        for got, merge in ((off, False), (on, True)):
            assert got["type"] == "VllmAllReduceRMSNormPass" and got["inactive"] is None, got
            assert got["merge"] is merge and got["moved"] == [merge, True], (form, got)
        assert on["uuid"] != off["uuid"], form
    # The two forms of one setting are the same pass: one compile-cache key.
    assert res["json True"]["uuid"] == res["python True"]["uuid"]


# -- the option at work ----------------------------------------------------------------

def _two_summed_all_reduces(a, b, r, w):
    """A DeepSeek-V3-style layer end: routed and shared experts reduced apart, summed, plus
    the residual, into an RMSNorm (Hugging Face's spelling)."""
    def all_reduce(x):
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.all_reduce(x, "sum", "tp"))

    h = all_reduce(a) + all_reduce(b) + r
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * v.to(h.dtype), h


@pytest.mark.parametrize("merge", [False, True])
def test_the_vllm_pass_merges_two_summed_all_reduces_only_when_asked(merge, monkeypatch) -> None:
    """The config helper's pass on a traced graph (fake tensors: nothing runs, so no process
    group exists; the matcher's group-size lookup answers 2 for the graph's group)."""
    from fusion_pass import records
    from fusion_pass.patterns import collectives

    monkeypatch.setattr(collectives, "c10d_world_size", lambda name: 2)
    args = [torch.randn(8, HIDDEN, dtype=torch.bfloat16) for _ in range(3)]
    gm = make_fx(_two_summed_all_reduces, tracing_mode="fake")(
        *args, torch.randn(HIDDEN, dtype=torch.bfloat16))
    assert calls(str(gm.graph), ALL_REDUCE) == 2
    start = len(records.HISTORY)
    _pass(compilation_config(merge_summed_all_reduces=merge))(gm.graph)
    sites = [s for rec in records.HISTORY[start:] for s in rec.sites]
    assert len(sites) == 2  # one record per all-reduce of the layer
    if merge:
        # One all-reduce of the summed inputs, fused with the residual add and the norm.
        after = str(gm.graph)
        assert calls(after, FUSED) == 1 and calls(after, ALL_REDUCE) == 0
        assert sites[0].fused and "merged into one" in sites[0].reason
        assert not sites[1].fused and sites[1].reason.startswith("merged into")
    else:
        assert calls(str(gm.graph), ALL_REDUCE) == 2 and calls(str(gm.graph), FUSED) == 0
        assert all(not s.fused and "summed with another all-reduce" in s.reason
                   for s in sites)

"""vLLM's CPU build, tensor parallelism 2, a tiny Llama: the fusion through the Python config.

One engine per configuration, shared between assertions (each takes about a
minute on two cores).  Every engine compiles from scratch, so the pass sees
every graph.
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
from torch import fx

vllm = pytest.importorskip("vllm", reason="vLLM (the CPU build in CI) is not importable")

from fusion_pass.tools import demo  # noqa: E402
from fusion_pass.vllm_integration import compilation_config  # noqa: E402

pytestmark = pytest.mark.vllm

SPEC = demo.ModelSpec("tiny-llama", hidden=256, layers=2)
DTYPE = "float32"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return demo.make_checkpoint(SPEC, tmp_path_factory.mktemp("ckpt"), dtype=DTYPE)


@pytest.fixture(scope="module")
def unfused(model, tmp_path_factory):
    return demo.run_vllm(model, tmp_path_factory.mktemp("off"), fusion=False, dtype=DTYPE)


@pytest.fixture(scope="module")
def fused(model, tmp_path_factory):
    return demo.run_vllm(model, tmp_path_factory.mktemp("on"), fusion=True, dtype=DTYPE)


@pytest.mark.slow
def test_every_site_fused_on_both_ranks(fused):
    assert sorted({g.rank for g in fused.graphs}) == [0, 1]
    for rank in (0, 1):
        sites = [s for g in fused.graphs if g.rank == rank for s in g.sites]
        assert len(sites) == SPEC.sites() == 5
        assert all(s.fused for s in sites), [s.reason for s in sites if not s.fused]
        assert {s.collective for s in sites} <= {"c10d_functional", "vllm_cpu_shm"}
        # The embedding's all-reduce feeds the first norm without a residual.
        assert sorted(s.norm for s in sites).count("native_plain") == 1
        assert all(s.hidden == SPEC.hidden and s.dtype == DTYPE and s.world_size == 2
                   for s in sites)


@pytest.mark.slow
def test_greedy_outputs_equal_unfused(fused, unfused):
    assert len(unfused.token_ids) == len(demo.PROMPTS)
    assert all(len(ids) == demo.MAX_TOKENS for ids in unfused.token_ids)
    assert fused.token_ids == unfused.token_ids
    assert unfused.graphs == []  # no pass, no records


@pytest.mark.slow
def test_unsupported_dtype_changes_nothing(model, unfused, tmp_path, fusion_log):
    cc = compilation_config(dtypes=["bfloat16"])
    run = demo.run_vllm(model, tmp_path, fusion=True, dtype=DTYPE, compilation=cc)
    assert run.token_ids == unfused.token_ids
    assert run.graphs == []
    said = [r.getMessage() for r in fusion_log if "does not apply" in r.getMessage()]
    assert len(said) == 1, said
    assert "float32" in said[0] and "unchanged" in said[0]


@pytest.mark.slow
def test_tp1_changes_nothing(model, tmp_path, fusion_log):
    off = demo.run_vllm(model, tmp_path / "off", fusion=False, tp=1, dtype=DTYPE)
    on = demo.run_vllm(model, tmp_path / "on", fusion=True, tp=1, dtype=DTYPE)
    assert on.token_ids == off.token_ids
    assert not any(g.sites for g in on.graphs)
    said = [r.getMessage() for r in fusion_log if "does not apply" in r.getMessage()]
    assert len(said) == 1, said
    assert "tensor_parallel_size=1" in said[0]


# -- the CPU build's shared-memory all-reduce form (AVX-512 builds) -------------

def _shm_graph(index: int):
    """``getitem(auto_functionalized(_C.shm_allreduce, handle=7, input=x), index)``."""
    from vllm.platforms import current_platform

    from fusion_pass.patterns import vllm_cpu

    current_platform.import_kernels()  # the real op, where this build has it
    op = getattr(getattr(torch.ops._C, "shm_allreduce", None), "default", None)
    if op is None:
        lib = torch.library.Library("_C", "FRAGMENT")  # noqa: F841  (kept alive below)
        lib.define("shm_allreduce(int handle, Tensor(a!) input) -> ()")
        _shm_graph.lib = lib
        op = torch.ops._C.shm_allreduce.default
    handle, tensor = (a.name for a in op._schema.arguments)
    g = fx.Graph()
    x = g.placeholder("x")
    af = g.call_function(torch.ops.higher_order.auto_functionalized, (op,),
                         {handle: 7, tensor: x})
    out = g.call_function(operator.getitem, (af, index))
    g.output(out)
    return vllm_cpu, x, af, out


def test_shm_form_maps_handle_to_group(monkeypatch):
    vllm_cpu, x, af, out = _shm_graph(1)

    class Group:
        world_size = 2

        class device_group:  # noqa: N801
            group_name = "5"

    monkeypatch.setattr(vllm_cpu, "shm_group", lambda h: Group if h == 7 else None)
    site = vllm_cpu._shm_all_reduce(out)
    assert site is not None
    assert (site.inp, site.group_name, site.world_size, site.form) == (x, "5", 2, "vllm_cpu_shm")
    assert site.nodes == [af, out]
    # Index 0 is the op's own (empty) output, not the reduced tensor.
    vllm_cpu, _, _, wrong = _shm_graph(0)
    assert vllm_cpu._shm_all_reduce(wrong) is None


# -- the pass's vLLM interface, without an engine -------------------------------

from vllm.config.utils import Range  # noqa: E402

def _config(tp: int, dtype: torch.dtype, hidden: int = 2880, cc=None):
    from types import SimpleNamespace

    model = SimpleNamespace(dtype=dtype, get_hidden_size=lambda: hidden)
    cc = cc or SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=None)
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           model_config=model, compilation_config=cc)


def test_prepare_decides_once_and_adds_endpoints(monkeypatch, fusion_log):
    from fusion_pass import backends
    from fusion_pass.gate import BackendLimits
    from fusion_pass.vllm_integration import VllmAllReduceRMSNormPass

    p = VllmAllReduceRMSNormPass(threshold=64)
    assert p.prepare(_config(2, torch.bfloat16)) == [64]
    assert p.inactive_reason is None
    assert p.prepare(_config(1, torch.bfloat16)) == []
    assert "tensor_parallel_size=1" in p.inactive_reason
    p.prepare(_config(1, torch.bfloat16))
    assert sum("does not apply" in r.getMessage() for r in fusion_log) == 1
    assert not p.is_applicable_for_range(Range(1, 8))

    # A backend with a byte limit: an endpoint there, and ranges above it skipped.
    limited = BackendLimits(name="limited", max_bytes=2880 * 2 * 1000,
                            dtypes=frozenset({"bfloat16"}))
    monkeypatch.setattr(backends, "selected_name", lambda device: "limited")
    monkeypatch.setattr(backends, "get", lambda name: type("B", (), {"limits": limited}))
    assert p.prepare(_config(2, torch.bfloat16)) == [64, 1000]
    assert p.is_applicable_for_range(Range(81, 1000))
    assert not p.is_applicable_for_range(Range(1001, 8192))
    assert p.prepare(_config(2, torch.float16)) == []
    assert "float16 is not supported" in p.inactive_reason


def test_endpoints_follow_the_backends_measured_schedule(monkeypatch, fusion_log):
    """A backend with a measured schedule (the Triton backend's table): vLLM cuts its
    compile ranges wherever the path changes, and each range gets one baked path."""
    from fusion_pass import backends, gate
    from fusion_pass.gate import BackendLimits, Path, Schedule
    from fusion_pass.vllm_integration import VllmAllReduceRMSNormPass

    wavy = BackendLimits(name="measured", max_bytes=2880 * 2 * 4096, schedules=(
        Schedule("bfloat16", 2, 2880, ((96, Path.ONE_STAGE), (768, Path.TWO_STAGE),
                                       (None, Path.ONE_STAGE))),))
    monkeypatch.setattr(backends, "selected_name", lambda device: "measured")
    monkeypatch.setattr(backends, "get", lambda name: type("B", (), {"limits": wavy}))
    log = logging.getLogger("fusion_pass")
    level = log.level
    log.setLevel(logging.INFO)
    try:
        p = VllmAllReduceRMSNormPass()
        assert p.prepare(_config(2, torch.bfloat16)) == [96, 768, 4096]
    finally:
        log.setLevel(level)
    for lo, hi, path in [(1, 96, Path.ONE_STAGE), (97, 768, Path.TWO_STAGE),
                         (769, 4096, Path.ONE_STAGE)]:
        assert gate.decide(2880, "bfloat16", 2, gate.TokenRange(lo, hi), limits=wavy).path is path
    assert any("[97, 768] two_stage" in r.getMessage() for r in fusion_log)
    # A forced threshold replaces the schedule.
    assert VllmAllReduceRMSNormPass(threshold=64).prepare(_config(2, torch.bfloat16)) == [64, 4096]


def test_configs_turn_vllms_in_tree_fusion_off_unless_told_otherwise():
    """vLLM's own pass runs first and would take every site: the helpers switch it off
    by default, keep other pass settings, and vLLM accepts the result."""
    import json

    from vllm.config import CompilationConfig

    from fusion_pass.vllm_integration import cli_json

    cc = compilation_config(base={"pass_config": {"eliminate_noops": True}})
    assert cc["pass_config"] == {"eliminate_noops": True, "fuse_allreduce_rms": False}
    parsed = CompilationConfig(**{k: v for k, v in cc.items() if k != "inductor_compile_config"})
    assert parsed.pass_config.fuse_allreduce_rms is False
    assert "pass_config" not in compilation_config(in_tree=None)
    assert json.loads(cli_json())["pass_config"] == {"fuse_allreduce_rms": False}
    assert json.loads(cli_json(in_tree=True))["pass_config"] == {"fuse_allreduce_rms": True}


def test_compile_range_from_pass_context():
    from vllm.compilation.passes.inductor_pass import pass_context

    from fusion_pass.gate import TokenRange
    from fusion_pass.vllm_integration import VllmAllReduceRMSNormPass

    p = VllmAllReduceRMSNormPass()
    assert p.compile_range() is None  # CPU mode: read the graph's shapes
    with pass_context(Range(81, 8192)):
        assert p.compile_range() == TokenRange(81, 8192)


def test_json_name_resolves_to_a_private_prepared_copy(fusion_log):
    from types import SimpleNamespace

    import fusion_pass
    from fusion_pass.vllm_integration import JSON_PASS, plugin

    plugin.register()
    shared = getattr(fusion_pass, JSON_PASS.split(".")[1])
    cc = SimpleNamespace(inductor_compile_config={"post_grad_custom_post_pass": shared},
                         compile_ranges_endpoints=[512])
    plugin.prepare_config(_config(2, torch.bfloat16, cc=cc))
    mine = cc.inductor_compile_config["post_grad_custom_post_pass"]
    assert mine is not shared and mine.model == (2880, "bfloat16") and shared.model is None
    assert cc.compile_ranges_endpoints == [80, 512]
    assert mine.uuid() != shared.uuid()

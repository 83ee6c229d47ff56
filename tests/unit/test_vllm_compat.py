"""The vLLM version layer: which vLLM the integration takes, and that any other one
gets one line and no change (the plugin, the config helpers and the pass itself)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fusion_pass.vllm_integration import compat  # noqa: E402


@pytest.fixture
def vllm_version(monkeypatch):
    """Pretend the installed vLLM has another version (the cached verdict reset)."""
    def pretend(version: str) -> None:
        monkeypatch.setattr(compat, "vllm_version", lambda: version)
        compat.unsupported_reason.cache_clear()

    yield pretend
    monkeypatch.undo()
    compat.unsupported_reason.cache_clear()


def test_the_installed_vllm_is_supported():
    from vllm.compilation.passes.inductor_pass import InductorPass

    assert compat.unsupported_reason() is None, compat.unsupported_reason()
    assert compat.InductorPass is InductorPass


@pytest.mark.parametrize("version,ok", [
    ("0.25.1", False), ("0.26.0", True), ("0.27.0", True), ("0.31.0", True),
    ("0.32.0+cpu", True), ("0.32.1.dev7+g1234abc", True), ("0.33.0", True), ("0.34.0", True),
    ("0.35.0", False), ("1.0.0", False), ("main", False)])
def test_versions_outside_the_range_are_refused_in_one_line(vllm_version, version, ok):
    vllm_version(version)
    reason = compat.unsupported_reason()
    assert (reason is None) == ok, reason
    if not ok:
        assert version in reason and "\n" not in reason


def test_any_version_env_lets_a_newer_vllm_try(vllm_version, monkeypatch):
    monkeypatch.setenv(compat.ANY_VERSION_ENV, "1")
    vllm_version("0.35.0")
    assert compat.unsupported_reason() is None


def test_unsupported_vllm_changes_nothing(vllm_version, fusion_log, monkeypatch):
    """The config helpers hand the base back, the plugin publishes a pass that runs
    nothing and hooks nothing, and each says the one line once per process."""
    from fusion_pass.allreduce_rmsnorm_pass import AllReduceRMSNormFusionPass
    from fusion_pass.vllm_integration import (VllmAllReduceRMSNormPass, cli_json,
                                              compilation_config, plugin)

    ran: list[object] = []
    monkeypatch.setattr(AllReduceRMSNormFusionPass, "__call__", lambda self, g: ran.append(g))
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        model_config=SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: 256),
        compilation_config=SimpleNamespace(pass_config=None))

    # Control: with this (supported) vLLM the pass runs the matcher.
    VllmAllReduceRMSNormPass(threshold=64).prepare(cfg)
    VllmAllReduceRMSNormPass(threshold=64)(torch.fx.Graph())
    assert len(ran) == 1

    vllm_version("0.25.0")
    base = {"mode": 3, "pass_config": {"eliminate_noops": True}}
    assert compilation_config(threshold=64, base=base) == base
    assert json.loads(cli_json(base=base)) == base
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_install_config_hook", lambda: pytest.fail("hooked vLLM"))
    plugin.register()
    import fusion_pass

    published = getattr(fusion_pass, plugin.JSON_NAME)
    assert "0.25.0" in published.inactive_reason
    assert published.prepare(cfg) == [] and published.inactive_reason is not None
    published(torch.fx.Graph())
    assert len(ran) == 1
    said = [r.getMessage() for r in fusion_log if r.levelno == logging.WARNING]
    assert len(said) == 1 and "vLLM 0.25.0 is outside" in said[0] and "\n" not in said[0]
    assert "runs unchanged" in said[0]


def test_sequence_parallel_settings_follow_this_vllms_pass_config():
    """vLLM 0.26-0.31 have sequence parallelism (it takes all-reduces before this pass);
    0.32 has none.  vLLM accepts what the helpers write either way."""
    from vllm.config import CompilationConfig

    from fusion_pass.vllm_integration import compilation_config

    has_sp = "enable_sp" in compat.pass_config_fields()
    cc = compilation_config(sequence_parallel=False)
    parsed = CompilationConfig(**{k: v for k, v in cc.items() if k != "inductor_compile_config"})
    assert parsed.pass_config.fuse_allreduce_rms is False
    if has_sp:
        assert cc["pass_config"] == {"fuse_allreduce_rms": False, "enable_sp": False,
                                     "fuse_gemm_comms": False}
        assert parsed.pass_config.enable_sp is False
        assert compat.sequence_parallel_settings(True) == {"enable_sp": True}
    else:
        assert cc["pass_config"] == {"fuse_allreduce_rms": False}
        with pytest.raises(ValueError, match="no sequence-parallelism pass"):
            compat.sequence_parallel_settings(True)


def test_sequence_parallel_start_is_read_from_the_final_config():
    def config(enable_sp, start):
        pc = SimpleNamespace(enable_sp=enable_sp, sp_min_token_num=start)
        return SimpleNamespace(compilation_config=SimpleNamespace(pass_config=pc))

    assert compat.sequence_parallel_from(config(True, 1024)) == 1024
    assert compat.sequence_parallel_from(config(False, 1024)) is None
    assert compat.sequence_parallel_from(config(True, None)) is None
    assert compat.sequence_parallel_from(SimpleNamespace(compilation_config=SimpleNamespace(
        pass_config=SimpleNamespace()))) is None

"""Models vLLM runs without compiling them: the plugin says once, plainly, that the
compile-time fusion cannot apply and why, and the pass records nothing.

vLLM 0.34 runs Qwen3.5, Qwen3.5-MoE and MistralLarge4 on CUDA from ``vllm/models/*/nvidia``
("eager + breakable CUDA-graph modelling code"): for breakable-by-default architectures it
enables breakable CUDA graphs and sets ``compilation_config.mode`` to NONE, so no post-grad
pass runs.  ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` does the same for any model, on any platform,
which is how a real config is made here; vLLM 0.32-0.33 do it too (their flag lives only in
the environment)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from fusion_pass.vllm_integration import compat  # noqa: E402

NOTICE = "all-reduce + RMSNorm fusion is enabled but does not apply"


@pytest.fixture
def tiny_llama(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16").save_pretrained(tmp_path)
    return str(tmp_path)


def _vllm_config(model_dir: str, **model_kwargs):
    from vllm.config import CompilationConfig, ModelConfig, ParallelConfig, VllmConfig

    from fusion_pass.vllm_integration import compilation_config, plugin

    plugin.register()  # the config hook, as vLLM's plugin loading runs it
    return VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                               dtype="bfloat16", **model_kwargs),
                      parallel_config=ParallelConfig(tensor_parallel_size=2),
                      compilation_config=CompilationConfig(**compilation_config()))


def _notices(fusion_log) -> list[str]:
    return [r.getMessage() for r in fusion_log if NOTICE in r.getMessage()]


def _pass_of(vc):
    return vc.compilation_config.inductor_compile_config["post_grad_custom_post_pass"]


def test_breakable_cuda_graphs_turn_the_fusion_off_with_one_notice(tiny_llama, monkeypatch,
                                                                    fusion_log):
    from vllm.config.utils import Range

    from fusion_pass import records

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    first, second = _vllm_config(tiny_llama), _vllm_config(tiny_llama)
    assert int(first.compilation_config.mode) == 0  # vLLM compiles nothing
    said = _notices(fusion_log)
    assert len(said) == 1, said  # two configs (as in the API server and the engine): once
    (msg,) = said
    assert "LlamaForCausalLM without torch.compile" in msg
    assert "breakable CUDA graphs" in msg and "compile-time" in msg
    assert "\n" not in msg and msg.endswith("The model runs unchanged.")
    for vc in (first, second):
        pass_ = _pass_of(vc)
        assert pass_.inactive_reason is not None
        assert not pass_.is_applicable_for_range(Range(1, 8192))
        # Called anyway, it records nothing (an active pass records every graph: the control).
        start = len(records.HISTORY)
        pass_(torch.fx.Graph())
        assert len(records.HISTORY) == start


def test_a_compiled_model_gets_no_notice(tiny_llama, monkeypatch, fusion_log):
    """Control: the same model compiled (the CPU build's plain torch.compile)."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    from fusion_pass import records

    vc = _vllm_config(tiny_llama)
    assert int(vc.compilation_config.mode) != 0
    assert _pass_of(vc).inactive_reason is None and _notices(fusion_log) == []
    # The active pass records every graph it is given, even one without sites.
    start = len(records.HISTORY)
    _pass_of(vc)(torch.fx.Graph())
    assert len(records.HISTORY) == start + 1


def test_enforce_eager_says_so(tiny_llama, monkeypatch, fusion_log):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    _vllm_config(tiny_llama, enforce_eager=True)
    (msg,) = _notices(fusion_log)
    assert "LlamaForCausalLM without torch.compile (enforce_eager)" in msg


@pytest.mark.parametrize("cc,model,why", [
    (dict(mode=0, use_breakable_cudagraph=True), dict(architectures=["Qwen3_5ForCausalLM"]),
     "Qwen3_5ForCausalLM without torch.compile (eager code captured in breakable CUDA graphs"),
    (dict(mode=0), dict(architectures=["MistralLarge4ForCausalLM"], enforce_eager=False),
     "MistralLarge4ForCausalLM without torch.compile (compilation mode NONE)"),
    (dict(mode=3, backend="eager"), dict(architectures=["LlamaForCausalLM"]),
     "LlamaForCausalLM with the 'eager' compilation backend"),
    (dict(mode=3, backend="inductor"), dict(architectures=["Qwen3_5ForCausalLM"]), None),
    (dict(mode=2, backend="inductor"), dict(architectures=["LlamaForCausalLM"]), None),
])
def test_why_vllm_compiles_nothing_is_read_from_the_final_config(monkeypatch, cc, model, why):
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    config = SimpleNamespace(compilation_config=SimpleNamespace(**cc),
                             model_config=SimpleNamespace(**model))
    reason = compat.compile_off_reason(config)
    assert (reason is None) == (why is None), reason
    if why is not None:
        assert why in reason


def test_before_034_breakable_graphs_are_read_from_the_environment(monkeypatch):
    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=0),
                             model_config=SimpleNamespace(architectures=["Qwen3_5ForCausalLM"]))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    assert "breakable CUDA graphs" in compat.compile_off_reason(config)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert "compilation mode NONE" in compat.compile_off_reason(config)


def test_notice_level_is_a_warning(tiny_llama, monkeypatch, fusion_log):
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    _vllm_config(tiny_llama)
    levels = {r.levelno for r in fusion_log if NOTICE in r.getMessage()}
    assert levels == {logging.WARNING}

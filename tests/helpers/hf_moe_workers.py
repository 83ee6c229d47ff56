"""Rank functions for tests/e2e/test_hf_moe_e2e.py: mixture-of-experts models at TP=2 on gloo.

* transformers' Mixtral and Qwen3-MoE, ``from_pretrained(dir, tp_plan="auto")``,
  tiny random configs: per decoder layer, o_proj's all-reduce feeds the
  post-attention norm, and the experts' all-reduce (reshaped back to
  ``[batch, seq, hidden]``) the next norm, both after a residual add.
* A DeepSeek-V3-style MoE layer written here (transformers' DeepSeek-V3 plan
  leaves attention unsharded and its MLA attention does not compile with a tiny
  config's head counts): routed experts and a shared expert, each row-parallel
  with its own all-reduce, summed, plus the residual, into the next norm.

:func:`all_cases` runs every case in one pair of processes, as tests/helpers/hf_tp_workers.py
does, and returns plain data.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

import hf_tp_workers as w

HF_MOE_MODELS = ("mixtral", "qwen3_moe")
DTYPES = ("float32", "bfloat16")
MODES = ("none", "true")
EXPERTS = 4
TOP_K = 2
MOE_LAYERS = 2


def hf_config(kind: str):
    import transformers

    common = dict(vocab_size=w.VOCAB, hidden_size=w.HIDDEN, intermediate_size=2 * w.HIDDEN,
                  num_hidden_layers=w.LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-3,
                  initializer_range=0.2, tie_word_embeddings=False,
                  num_experts_per_tok=TOP_K)
    if kind == "mixtral":
        return transformers.MixtralConfig(num_local_experts=EXPERTS, **common)
    if kind == "qwen3_moe":
        # Every layer sparse: its MLP is the experts alone.
        return transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=w.HIDDEN,
                                           decoder_sparse_step=1, mlp_only_layers=[], **common)
    raise ValueError(kind)


def expected_sites(kind: str) -> int:
    """All-reduce -> norm sites of one forward, from the architecture: per decoder
    layer, o_proj's (-> post-attention norm) and the experts' (-> the next layer's
    input norm or the final norm), each after a residual add."""
    return 2 * w.LAYERS


def hf_moe_cases(kind: str, path: str) -> dict:
    """Per dtype: the unfused compile (dynamic=None) and the fused compile in both
    modes, of one forward over the prompt."""
    import transformers

    ids = torch.randint(0, w.VOCAB, (1, w.PROMPT), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for dtype_name in DTYPES:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", dtype=getattr(torch, dtype_name)).eval()

        def call(model=model):
            return model(ids, use_cache=False).logits

        out[(dtype_name, "none", False)] = w.compiled_run(model, None, False, call)
        for mode in MODES:
            out[(dtype_name, mode, True)] = w.compiled_run(model, w.MODES[mode], True, call)
    return out


class DeepSeekStyleMoE(torch.nn.Module):
    """``MOE_LAYERS`` MoE layers (no attention): router replicated, each expert's and
    the shared expert's up projection column-parallel and down projection
    row-parallel, so that the routed sum and the shared sum are each a partial
    sum; ``h = h + (all_reduce(routed) + all_reduce(shared))``, then an RMSNorm
    (Hugging Face style) of ``h``: one norm per layer fed by two all-reduces."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype, group) -> None:
        super().__init__()
        self.group = group
        g = torch.Generator().manual_seed(11)
        inner = 2 * w.HIDDEN

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t.contiguous().to(dtype), requires_grad=False)

        def shard(rows: int, cols: int, dim: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) / cols ** 0.5).chunk(world_size, dim)[rank]

        self.router = torch.nn.ParameterList(
            param(torch.randn(EXPERTS, w.HIDDEN, generator=g)) for _ in range(MOE_LAYERS))
        self.up = torch.nn.ParameterList(
            param(torch.stack([shard(inner, w.HIDDEN, 0) for _ in range(EXPERTS)]))
            for _ in range(MOE_LAYERS))
        self.down = torch.nn.ParameterList(
            param(torch.stack([shard(w.HIDDEN, inner, 1) for _ in range(EXPERTS)]))
            for _ in range(MOE_LAYERS))
        self.shared_up = torch.nn.ParameterList(param(shard(inner, w.HIDDEN, 0)) for _ in range(MOE_LAYERS))
        self.shared_down = torch.nn.ParameterList(param(shard(w.HIDDEN, inner, 1)) for _ in range(MOE_LAYERS))
        self.norms = torch.nn.ParameterList(
            param(1 + 0.1 * torch.randn(w.HIDDEN, generator=g)) for _ in range(MOE_LAYERS + 1))

    def _norm(self, i: int, h: torch.Tensor) -> torch.Tensor:
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-3)
        return self.norms[i] * v.to(h.dtype)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as fc

        act = torch.nn.functional.silu
        scores = torch.softmax(x.float() @ self.router[i].float().t(), dim=-1)
        top, idx = scores.topk(TOP_K, dim=-1)
        # Dense dispatch: every expert runs on every token, weighted by its gate (0
        # when not chosen); the same sum as a sparse dispatch, without data-dependent shapes.
        gates = torch.zeros_like(scores).scatter(-1, idx, top / top.sum(-1, keepdim=True)).to(x.dtype)
        routed = sum(gates[:, e:e + 1] * (act(x @ self.up[i][e].t()) @ self.down[i][e].t())
                     for e in range(EXPERTS))
        shared = act(x @ self.shared_up[i].t()) @ self.shared_down[i].t()
        return fc.all_reduce(routed, "sum", self.group) + fc.all_reduce(shared, "sum", self.group)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self._norm(0, h)
        for i in range(MOE_LAYERS):
            h = h + self._moe(i, y)
            y = self._norm(i + 1, h)
        return y, h


def deepseek_cases(rank: int, world_size: int) -> dict:
    """Per dtype: unfused; fused as it stands (both all-reduces left, with a reason);
    fused with ``merge_summed_all_reduces`` in both modes."""
    import torch.distributed as dist

    out = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        model = DeepSeekStyleMoE(rank, world_size, dtype, dist.group.WORLD)
        h = torch.randn(24, w.HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)

        def call(model=model, h=h):
            return model(h)

        out[(dtype_name, "none", False)] = w.compiled_run(model, None, False, call)
        out[(dtype_name, "none", "as_is")] = w.compiled_run(model, None, True, call)
        for mode in MODES:
            out[(dtype_name, mode, "merged")] = w.compiled_run(
                model, w.MODES[mode], True, call, merge_summed_all_reduces=True)
    return out


def all_cases(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    w._tp_env(rank, world_size)
    paths = {kind: os.path.join(root, kind) for kind in HF_MOE_MODELS}
    if rank == 0:
        import transformers

        for kind, path in paths.items():
            if not os.path.exists(path):
                torch.manual_seed(0)
                transformers.AutoModelForCausalLM.from_config(hf_config(kind)).save_pretrained(path)
    dist.barrier()
    cases: dict[str, Callable[[], dict]] = {
        kind: (lambda kind=kind: hf_moe_cases(kind, paths[kind])) for kind in HF_MOE_MODELS}
    cases["deepseek_style"] = lambda: deepseek_cases(rank, world_size)
    return w.run_each(cases)

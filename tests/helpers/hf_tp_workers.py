"""Rank functions for tests/e2e/test_hf_tp_e2e.py: real transformers models at TP=2 on gloo.

:func:`all_cases` runs on both ranks (``fusion_pass.testing.spawn.run_ranks``), compiles
each model with and without the pass, and returns plain data: per compile the
post-grad graphs the pass was given (op counts, the fused ops' arguments, the text
after each all-reduce for failure messages), the sites the pass recorded, outputs.
"""

from __future__ import annotations

import os
import re
import traceback
from typing import Any, Callable, Optional

import torch

FUSED_OP = "fusion_pass.allreduce_rmsnorm.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"
MODES = {"none": None, "true": True}
"""``torch.compile(dynamic=...)`` by the name the tests use."""

# Tiny shapes: every matmul splits over 2 ranks, heads divide by 2, and the hidden
# size fits the gate's one-stage rule in bf16 and fp32 (whole 16-byte packs).
HIDDEN = 64
LAYERS = 1
"""One decoder layer holds both kinds of site (o_proj -> post-attention norm, down_proj
-> the next norm, the first site's sum the second one's residual); each more layer
adds about a quarter to every compile, and the CI machine has 2 cores."""
VOCAB = 128
PROMPT = 7
NEW_TOKENS = 3

HF_MODELS = ("llama", "qwen3", "gemma3", "granite", "llama_parallelize_module",
             "granite_parallelize_module")
FUSED_COMPILES = (("float32", "none"), ("float32", "true"), ("bfloat16", "none"), ("bfloat16", "true"))
BASELINE_MODE = {"float32": "true", "bfloat16": "none"}
"""The unfused reference of each dtype is compiled once, in the mode that compiles
fastest (fp32 generation: one dynamic=True graph instead of dynamic=None's two; one
static bf16 forward). Inductor's numerics do not depend on the mode beyond rounding,
and a baseline per mode would add the slowest compiles, the dynamic=True ones."""


def hf_config(kind: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=64,
                  # Large next to the activations' mean square, so that a wrong eps
                  # moves the fp32 logits past the tolerance.
                  rms_norm_eps=1e-3,
                  # Larger than the default 0.02: logits far from ties, so greedy tokens
                  # cannot flip on fp32 rounding differences between two compiles.
                  initializer_range=0.2, tie_word_embeddings=False)
    if kind in ("llama", "llama_parallelize_module"):
        return transformers.LlamaConfig(**common)
    if kind in ("granite", "granite_parallelize_module"):
        # A scalar multiplies every reduced value (the embedding's, o_proj's, down_proj's);
        # Granite's head size is hidden / heads.
        common.pop("head_dim")
        return transformers.GraniteConfig(embedding_multiplier=6.0, residual_multiplier=0.22,
                                          attention_multiplier=0.25, logits_scaling=4.0,
                                          **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(sliding_window=16, **common)
    raise ValueError(kind)


def write_checkpoint(kind: str, path: str) -> None:
    """Random weights, norm weights included (they start as ones, Gemma's as zeros)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


def expected_sites(kind: str) -> list[tuple[bool, bool, bool]]:
    """(residual add, Gemma's ``1 + w``, a scalar multiplier) of every all-reduce ->
    norm site of one forward.

    Per layer, from the model's structure: o_proj's all-reduce feeds the
    post-attention norm and down_proj's the next one (Llama, Qwen3, Granite: the next
    layer's input norm or the final norm, each after the residual add; Gemma3: its
    sandwich norms, post-attention and post-feedforward, directly on the reduced
    value). Granite multiplies every reduced value by a scalar first
    (``residual_multiplier``; the embedding's by ``embedding_multiplier``).
    torchtitan's plan shards the embedding by vocabulary, whose all-reduce feeds
    layer 0's input norm (no residual yet); transformers' plans leave the embedding
    replicated (Gemma3 multiplies its embedding by the normalizer inside the
    embedding module, before any all-reduce)."""
    gemma, granite = kind == "gemma3", kind.startswith("granite")
    embedding = [(False, False, granite)] if kind.endswith("_parallelize_module") else []
    return sorted(embedding + [(not gemma, gemma, granite)] * 2 * LAYERS)


# --- recording ------------------------------------------------------------------------

def _count(graph: str, target: str) -> int:
    return graph.count(f"target=torch.ops.{target}]") + graph.count(f"target={target}]")


def _after_all_reduces(graph: str, lines_after: int = 14) -> list[str]:
    """The post-grad text from each all-reduce on, where its norm should be."""
    lines = graph.splitlines()
    return ["\n".join(lines[i:i + lines_after]) for i, line in enumerate(lines)
            if f"torch.ops.{ALL_REDUCE}]" in line]


def _fused_op_args(graph) -> list[tuple[bool, bool, bool]]:
    """(residual given, gemma, a multiplier) of each fused op, read by the op's
    argument names and its spec."""
    from fx_text import fused_fields

    op = torch.ops.fusion_pass.allreduce_rmsnorm.default
    fields = [fused_fields(node) for node in graph.nodes if node.target is op]
    return sorted((f["residual"] is not None, f["gemma"], f["multiplier"] is not None)
                  for f in fields)


def recording_pass(fuse: bool, **options):
    """The fusion pass (``fuse``, constructed with ``options``), or a pass that only
    looks (the unfused baseline); either way every post-grad graph it is given is
    summarised in ``graphs``."""
    from fusion_pass import AllReduceRMSNormFusionPass

    class Recording(AllReduceRMSNormFusionPass):
        def __init__(self) -> None:
            super().__init__(**options)
            self.graphs: list[dict] = []

        def __call__(self, graph) -> None:
            before = str(graph)
            if fuse:
                super().__call__(graph)
            after = str(graph)
            self.graphs.append(dict(
                all_reduce_before=_count(before, ALL_REDUCE), all_reduce_after=_count(after, ALL_REDUCE),
                rsqrt_before=_count(before, "aten.rsqrt.default"),
                rsqrt_after=_count(after, "aten.rsqrt.default"),
                fused_ops=_count(after, FUSED_OP), fused_args=_fused_op_args(graph),
                text=_after_all_reduces(before)))

        def uuid(self) -> str:
            return super().uuid() + ("fuse" if fuse else "look") + repr(sorted(options.items()))

    return Recording()


def compiled_run(module: torch.nn.Module, dynamic: Optional[bool], fuse: bool,
                 call: Callable[[], Any], **options) -> dict:
    """``call()`` with ``module.forward`` compiled (fullgraph) with or without the pass.

    Dynamo is reset before and after, so that no graph of one compile serves the
    other, and the pass is in Inductor's config only while this one runs."""
    from torch._inductor import config

    from fusion_pass import records

    rec = recording_pass(fuse, **options)
    start = len(records.HISTORY)
    torch._dynamo.reset()
    original = module.forward
    try:
        # transformers' Qwen3 and Gemma3 plans put full backward hooks on q_norm and
        # k_norm ("replicated_with_grad_allreduce"). Dynamo traces through such hooks
        # only with compiled autograd on (read when torch.compile is called); without
        # it each such norm breaks the graph, and all-reduces land in one graph and
        # their norms in the next, or run in eager.
        with torch._dynamo.config.patch(compiled_autograd=True):
            module.forward = torch.compile(original, dynamic=dynamic, fullgraph=True)
        with config.patch(post_grad_custom_post_pass=rec), torch.inference_mode():
            out = call()
    finally:
        module.forward = original
        torch._dynamo.reset()
    sites = [[dict(path=s.path, reason=s.reason, norm=s.norm, tokens=s.tokens, dtype=s.dtype)
              for s in g.sites] for g in records.HISTORY[start:]]
    return dict(graphs=rec.graphs, sites=sites, out=out)


# --- transformers models --------------------------------------------------------------

def _load(kind: str, path: str, dtype: torch.dtype, world_size: int) -> tuple[Any, int]:
    """The model, and how many all-reduces its TP plan puts in a forward (one per
    rowwise module: its output is a partial sum)."""
    import transformers

    if not kind.endswith("_parallelize_module"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
        assert model.tp_size == world_size, f"transformers loaded tp_size {model.tp_size}"
        rowwise = sum("rowwise" in model.tp_plan.get(re.sub(r"\.\d+\.", ".*.", name), "")
                      for name, _ in model.named_modules())
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        rowwise = _parallelize_torchtitan_style(model, world_size)
    return model.eval(), rowwise


def _parallelize_torchtitan_style(model, world_size: int) -> int:
    """torch's own tensor parallelism as torchtitan plans a Llama (without sequence
    parallelism): vocab-sharded embedding, colwise q/k/v/gate/up, rowwise o/down,
    colwise output gathered. Returns the number of rowwise modules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world_size,))
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
           "lm_head": ColwiseParallel(output_layouts=Replicate())}
    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, mesh, top)
    for block in model.model.layers:
        parallelize_module(block, mesh, layer)
    plans = [top] + [layer] * len(model.model.layers)
    return sum(isinstance(style, RowwiseParallel) for plan in plans for style in plan.values())


def _tp_env(rank: int, world_size: int) -> None:
    # What torchrun sets: transformers sizes its TP mesh from WORLD_SIZE, and with
    # it unset loads an unsharded model without a word.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def hf_model_cases(rank: int, world_size: int, kind: str, path: str) -> dict:
    """The unfused and the fused compiles of one model: fp32 greedy generation
    (tokens and each step's logits), bf16 logits of the prompt."""
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    # With DTensor parameters, an lm_head on the sequence sliced to its last
    # position (generate's logits_to_keep=1) fails in Dynamo under dynamic shapes
    # (torch 2.13, the fake-tensor run of the DTensor linear: "unhashable type:
    # non-nested SymInt"): that model computes every position's logits.
    keep = dict(logits_to_keep=0) if kind.endswith("_parallelize_module") else {}
    out: dict = {}
    for dtype_name in ("float32", "bfloat16"):
        model, rowwise = _load(kind, path, getattr(torch, dtype_name), world_size)
        out[("plan_all_reduces", dtype_name)] = rowwise
        if dtype_name == "float32":
            def call():
                # No KV cache: every step is one forward over the whole sequence, so
                # each compiled graph is a whole forward with every site in it.
                g = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                   do_sample=False, use_cache=False, output_logits=True,
                                   return_dict_in_generate=True, **keep)
                return dict(tokens=g.sequences, logits=torch.stack(g.logits))
        else:
            def call():
                return dict(logits=model(ids, use_cache=False).logits)
        base = BASELINE_MODE[dtype_name]
        out[(dtype_name, base, False)] = compiled_run(model, MODES[base], False, call)
        for dt, mode in FUSED_COMPILES:
            if dt == dtype_name:
                out[(dtype_name, mode, True)] = compiled_run(model, MODES[mode], True, call)
    return out


def all_cases(rank: int, world_size: int, root: str) -> dict:
    """Every model, then the hand-sharded decoder, in one pair of processes: a spawn
    costs seconds of imports that the 2-core CI machine cannot spare. A case that
    raises leaves its traceback (both ranks run the same code on the same shapes,
    so they fail alike rather than leave one waiting in a collective)."""
    import torch.distributed as dist

    _tp_env(rank, world_size)
    paths = {kind: os.path.join(root, kind) for kind in ("llama", "qwen3", "gemma3", "granite")}
    paths["llama_parallelize_module"] = paths["llama"]
    paths["granite_parallelize_module"] = paths["granite"]
    if rank == 0:
        for kind, path in paths.items():
            if not os.path.exists(path):
                write_checkpoint(kind, path)
    dist.barrier()
    cases: dict[str, Callable[[], dict]] = {
        kind: (lambda kind=kind: hf_model_cases(rank, world_size, kind, paths[kind]))
        for kind in HF_MODELS}
    cases["decoder"] = lambda: decoder_cases(rank, world_size)
    return run_each(cases)


# --- a hand-sharded decoder built from transformers' norm classes ------------------------

NORM_CLASSES = ("LlamaRMSNorm", "Qwen3RMSNorm", "Gemma3RMSNorm")
# Distinct, and large next to the activations' mean square (about 1): an eps read
# from the wrong norm, or dropped, shows in the numerics.
NORM_EPS = {"LlamaRMSNorm": 1e-2, "Qwen3RMSNorm": 3e-2, "Gemma3RMSNorm": 6e-2}


def _norm_class(name: str):
    import transformers.models.gemma3.modeling_gemma3 as gemma3
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    return {"LlamaRMSNorm": llama.LlamaRMSNorm, "Qwen3RMSNorm": qwen3.Qwen3RMSNorm,
            "Gemma3RMSNorm": gemma3.Gemma3RMSNorm}[name]


class ShardedDecoder(torch.nn.Module):
    """One layer per norm class, each a colwise -> rowwise "attention" and "MLP" with
    an all-reduce after each and residual adds; after every all-reduce comes a norm
    (post-attention, then the next layer's input norm or the final norm): 2 sites
    per layer. The norms are transformers' modules, eps a float attribute of each."""

    def __init__(self, rank: int, world_size: int, dtype: torch.dtype, norm_dtype: torch.dtype,
                 group) -> None:
        super().__init__()
        self.group, self.dtype = group, dtype
        g = torch.Generator().manual_seed(3)
        inner = 2 * HIDDEN

        def shard(rows: int, cols: int, dim: int) -> torch.nn.Parameter:
            full = torch.randn(rows, cols, generator=g) / cols ** 0.5
            return torch.nn.Parameter(full.chunk(world_size, dim)[rank].contiguous().to(dtype),
                                      requires_grad=False)

        def norm(name: str) -> torch.nn.Module:
            n = _norm_class(name)(HIDDEN, eps=NORM_EPS[name])
            with torch.no_grad():  # Gemma's weight is an offset from 1
                n.weight.copy_(0.1 * torch.randn(HIDDEN, generator=g) + (name != "Gemma3RMSNorm"))
            return n.to(norm_dtype).requires_grad_(False)

        self.in_norms = torch.nn.ModuleList(norm(n) for n in NORM_CLASSES)
        self.post_norms = torch.nn.ModuleList(norm(n) for n in NORM_CLASSES)
        self.final_norm = norm(NORM_CLASSES[0])
        self.col = torch.nn.ParameterList(shard(inner, HIDDEN, 0) for _ in range(2 * len(NORM_CLASSES)))
        self.row = torch.nn.ParameterList(shard(HIDDEN, inner, 1) for _ in range(2 * len(NORM_CLASSES)))

    def _block(self, i: int, y: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as fc

        # A norm with fp32 weights hands back fp32 (Llama's weight * x.to(bf16)); the
        # next matmul runs in the model dtype, as under autocast.
        a = torch.nn.functional.silu(y.to(self.dtype) @ self.col[i].t()) @ self.row[i].t()
        return fc.all_reduce(a, "sum", self.group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        y = self.in_norms[0](h)
        for i in range(len(NORM_CLASSES)):
            h = h + self._block(2 * i, y)
            y = self.post_norms[i](h)
            h = h + self._block(2 * i + 1, y)
            y = (self.in_norms[i + 1] if i + 1 < len(NORM_CLASSES) else self.final_norm)(h)
        return y, h


DECODER_VARIANTS = {
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float32": (torch.float32, torch.float32),
    "bfloat16_fp32_norm_weights": (torch.bfloat16, torch.float32),
}
# Sites by the norm after them: post-attention Llama, input Qwen3, post-attention
# Qwen3, input Gemma3, post-attention Gemma3, final Llama; all after a residual add.
DECODER_SITES = sorted([(True, False, False)] * 4 + [(True, True, False)] * 2)


def decoder_cases(rank: int, world_size: int) -> dict:
    """Each variant compiled with dynamic=True, unfused and fused, on random activations."""
    import torch.distributed as dist

    out = {}
    for name, (dtype, norm_dtype) in DECODER_VARIANTS.items():
        model = ShardedDecoder(rank, world_size, dtype, norm_dtype, dist.group.WORLD)
        x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
        for fuse in (False, True):
            out[(name, fuse)] = compiled_run(model, True, fuse, lambda m=model, x=x: m(x))
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_each(cases: dict[str, Callable[[], dict]]) -> dict:
    """Every case's result, or its traceback: one failing case does not hide the others."""
    out: dict = {}
    for name, run in cases.items():
        try:
            out[name] = run()
        except Exception:
            out[name] = traceback.format_exc()
    return out


def rank_cases(ranks: list[dict], name: str) -> list[dict]:
    """Case ``name`` of every rank; the test fails with the traceback of a rank that raised."""
    import pytest

    for r in ranks:
        if isinstance(r[name], str):
            pytest.fail(f"{name} raised on a rank:\n{r[name]}")
    return [r[name] for r in ranks]

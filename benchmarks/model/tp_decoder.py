"""A tensor-parallel decoder in plain torch, with random weights, for benchmarking the pass.

Megatron-style sharding over one process group: QKV and gate/up are
column-parallel, o_proj and down_proj row-parallel and followed by
``torch.distributed._functional_collectives.all_reduce``; residual adds and
RMSNorm are written as Hugging Face writes them, so every all-reduce feeds
``residual + x`` and an RMSNorm, which is what the fusion pass looks for.

The compiled unit is one decoder layer (:func:`decoder_layer`) that takes its
weights as arguments: one compile serves every layer of a model, which keeps
compile time independent of the layer count.  A layer starts from the normed
input of its attention and ends with the norm of the *next* layer's input (or
the final norm), so it holds both of the layer's all-reduce -> add -> RMSNorm
sites:

* o_proj all-reduce -> ``+ residual`` -> post-attention norm;
* down_proj all-reduce -> ``+ residual`` -> next layer's input norm (the last
  layer: the final norm).

The first layer's input norm is not a site: the embedding is replicated on
every rank, so no all-reduce precedes it (a vocab-parallel embedding, as in
vLLM, would make it a third, residual-free site).

Shapes are flattened to ``[tokens, hidden]`` as in vLLM; the KV cache of a
layer is ``[batch, kv_heads_per_rank, pos + new, head_dim]``, so the position of
the new tokens is read from shapes (``pos = cache_len - new``) and nothing but
tensors crosses the compiled boundary.

FP8 models (``ModelConfig.quant``) hold every linear layer's weight in
``float8_e4m3fn`` and run it with ``torch._scaled_mm``; each activation is
quantized right before its linear layer, written in plain torch as a graph
would have it: per tensor with a static (checkpoint) scale
(:func:`quant_static`, Llama-3 FP8 style) or per 1 x 128 group with a dynamic
scale (:func:`quant_group`, DeepSeek's recipe, weights per 128 x 128 block).
A layer then passes the next layer the quantized norm output ``(q, scales)``
instead of ``y``, so that each norm and the quantization after it are in one
graph, where the pass can fuse both into the all-reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float = 1e-5
    rope_theta: float = 500000.0
    real_layers: Optional[int] = None  # the layer count of the model this one imitates
    note: str = ""
    quant: Optional[str] = None  # FP8 models: "static" (per tensor) or "group128"


CONFIGS: dict[str, ModelConfig] = {
    "gpt-oss-like": ModelConfig(
        "gpt-oss-like", hidden=2880, heads=64, kv_heads=8, head_dim=64,
        intermediate=2880 * 4, layers=8, vocab=201088, rope_theta=150000.0, real_layers=36,
        note="dense MLP (intermediate 4 x 2880) in place of GPT-OSS's mixture of experts; "
             "full attention in every layer (GPT-OSS alternates sliding-window layers)"),
    "llama3-8b-like": ModelConfig(
        "llama3-8b-like", hidden=4096, heads=32, kv_heads=8, head_dim=128,
        intermediate=14336, layers=8, vocab=128256, real_layers=32),
    "llama3-70b-like": ModelConfig(
        "llama3-70b-like", hidden=8192, heads=64, kv_heads=8, head_dim=128,
        intermediate=28672, layers=8, vocab=128256, real_layers=80),
    "llama3-70b-fp8": ModelConfig(
        "llama3-70b-fp8", hidden=8192, heads=64, kv_heads=8, head_dim=128,
        intermediate=28672, layers=8, vocab=128256, real_layers=80, quant="static",
        note="FP8 e4m3 weights (one scale per tensor) and activations (a static scale per "
             "linear layer), as Llama-3 FP8 checkpoints; the lm_head is FP8 too"),
    "deepseek-like-fp8": ModelConfig(
        "deepseek-like-fp8", hidden=7168, heads=56, kv_heads=8, head_dim=128,
        intermediate=18432, layers=8, vocab=129280, rope_theta=10000.0, real_layers=61,
        quant="group128",
        note="DeepSeek-V3's hidden size, dense-MLP width and FP8 recipe (weights per 128 x 128 "
             "block, activations per 1 x 128 group, dynamic); GQA attention in place of MLA "
             "and a dense MLP in every layer (V3: 3 dense layers, then mixture of experts)"),
    # Tiny: run compiled on 2 gloo CPU ranks in seconds.
    "smoke": ModelConfig(
        "smoke", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
        layers=2, vocab=256),
    "smoke-fp8": ModelConfig(
        "smoke-fp8", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
        layers=2, vocab=256, quant="static"),
    "smoke-fp8-group": ModelConfig(
        "smoke-fp8-group", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256,
        layers=2, vocab=256, quant="group128"),
}

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
GROUP_SCALE_FLOOR = 1e-10 / FP8_MAX
"""vLLM's per-token-group floor: ``max(amax, 1e-10) / 448``."""
ACT_RANGE = {"norm": 8.0, "attn": 4.0, "mlp": 16.0}
"""Static models: the calibrated range of each linear layer's input (its scale is
range / 448), from the weights' initialisation: norm outputs stay within +-8,
attention outputs within +-4, the gated MLP activation within +-16."""
GEMMS = ("scaled_mm", "dequant")


@dataclass(frozen=True)
class Shard:
    """What one rank holds of a model: per-rank head and MLP counts, the group."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    group_name: str
    quant: Optional[str] = None
    gemm: str = "scaled_mm"
    """Per-group FP8 models: ``scaled_mm`` (blockwise ``torch._scaled_mm``) or
    ``dequant`` (dequantize, then a bf16 GEMM) where that is unavailable."""

    @classmethod
    def of(cls, cfg: ModelConfig, world_size: int, group_name: str,
           gemm: str = "scaled_mm") -> "Shard":
        for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads),
                        ("intermediate", cfg.intermediate), ("vocab", cfg.vocab)):
            if n % world_size:
                raise ValueError(f"{cfg.name}: {what}={n} is not divisible by TP={world_size}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, not {gemm!r}")
        s = cls(cfg.hidden, cfg.heads // world_size, cfg.kv_heads // world_size, cfg.head_dim,
                cfg.intermediate // world_size, cfg.eps, group_name, cfg.quant, gemm)
        if cfg.quant == "group128":
            # Every GEMM's K and N split into whole 128-element blocks on every rank.
            dims = {"hidden": s.hidden, "attention width": s.heads * s.head_dim,
                    "qkv rows": (s.heads + 2 * s.kv_heads) * s.head_dim,
                    "intermediate": s.intermediate, "vocab shard": cfg.vocab // world_size}
            bad = {k: v for k, v in dims.items() if v % GROUP}
            if bad:
                raise ValueError(f"{cfg.name}: per-rank {bad} not multiples of {GROUP}")
        elif cfg.quant not in (None, "static"):
            raise ValueError(f"{cfg.name}: quant must be None, 'static' or 'group128'")
        return s


class FP8Linear(NamedTuple):
    """A linear layer's weight in FP8, and what its input's quantization needs."""

    weight: torch.Tensor               # [N, K] float8_e4m3fn
    scale: torch.Tensor                # fp32: [] per tensor, [N / 128, K / 128] per block
    in_scale: Optional[torch.Tensor]   # static models: the input's scale, [] fp32
    dequant: Optional[torch.Tensor]    # gemm "dequant": the weight dequantized, [N, K] bf16


Linear = Union[torch.Tensor, FP8Linear]


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor   # [hidden], replicated
    qkv: Linear                # [(heads + 2 kv_heads) * head_dim, hidden], this rank's heads
    o: Linear                  # [hidden, heads * head_dim], this rank's input columns
    post_norm: torch.Tensor    # [hidden], replicated
    gate_up: Linear            # [2 * intermediate, hidden], this rank's rows
    down: Linear               # [hidden, intermediate], this rank's input columns


class Weights(NamedTuple):
    embed: torch.Tensor        # [vocab, hidden], replicated
    layers: list[LayerWeights]
    final_norm: torch.Tensor   # [hidden], replicated
    lm_head: Linear            # [vocab / tp, hidden], this rank's vocab rows
    inv_freq: torch.Tensor     # [head_dim / 2], fp32


Act = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
"""A layer's normed input: ``y`` in bf16, or ``(q, scales)`` in an FP8 model."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, verbatim in behaviour."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 with a checkpoint's static scale, spelled as a graph has it."""
    return (x.float() * (1 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)


def quant_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 per 1 x 128 group: ``(q, scales [tokens, hidden / 128])``."""
    xg = x.float().unflatten(-1, (-1, GROUP))
    scales = (xg.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=GROUP_SCALE_FLOOR)
    q = (xg / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2), scales.squeeze(-1)


def quantize_act(s: Shard, x: torch.Tensor,
                 in_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of an activation; a static model's scales are its ``in_scale``."""
    if s.quant == "static":
        assert in_scale is not None
        return quant_static(x, in_scale), in_scale
    return quant_group(x)


def fp8_linear(s: Shard, act: tuple[torch.Tensor, torch.Tensor], w: FP8Linear) -> torch.Tensor:
    """``act @ w.T`` in bf16 from FP8 operands and their scales."""
    q, scales = act
    if s.quant == "static":
        return torch._scaled_mm(q, w.weight.t(), scale_a=scales, scale_b=w.scale,
                                out_dtype=torch.bfloat16)
    if s.gemm == "scaled_mm":
        # cuBLAS takes the 1 x 128 scales column-major and the 128 x 128 ones as [K/128, N/128].
        return torch._scaled_mm(q, w.weight.t(), scale_a=scales.t().contiguous().t(),
                                scale_b=w.scale.t(), out_dtype=torch.bfloat16)
    assert w.dequant is not None
    x = (q.float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)).flatten(-2)
    return F.linear(x.to(torch.bfloat16), w.dequant)


def _linear(s: Shard, x: Act, w: Linear) -> torch.Tensor:
    """A linear layer; an FP8 model quantizes a bf16 input first."""
    if s.quant is None:
        assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
        return F.linear(x, w)
    assert isinstance(w, FP8Linear)
    act = x if isinstance(x, tuple) else quantize_act(s, x, w.in_scale)
    return fp8_linear(s, act, w)


def _norm(s: Shard, h: torch.Tensor, weight: torch.Tensor,
          in_scale: Optional[torch.Tensor]) -> Act:
    """RMSNorm and, in an FP8 model, the quantization of its output for the next linear."""
    y = rms_norm(h, weight, s.eps)
    return y if s.quant is None else quantize_act(s, y, in_scale)


def _in_scale(w: Linear) -> Optional[torch.Tensor]:
    return w.in_scale if isinstance(w, FP8Linear) else None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def prologue(s: Shard, tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
             norm: torch.Tensor, inv_freq: torch.Tensor, in_scale: Optional[torch.Tensor] = None
             ) -> tuple[Act, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embedding, the first layer's input norm and the rotary table: (y, h, cos, sin)."""
    h = F.embedding(tokens, embed)
    cos, sin = rope_cos_sin(positions, inv_freq, h.dtype)
    return _norm(s, h, norm, in_scale), h, cos, sin


def decoder_layer(s: Shard, w: LayerWeights, next_norm: torch.Tensor, y: Act,
                  h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor,
                  next_in_scale: Optional[torch.Tensor] = None) -> tuple[Act, torch.Tensor]:
    """One layer from its normed input ``y`` and residual ``h`` to the next layer's (y, h).

    ``y, h``: ``[batch * new, hidden]`` (in an FP8 model ``y`` is ``(q, scales)``
    and ``next_in_scale`` the next linear's static input scale); the new
    tokens' keys and values are written at the end of the caches, and
    attention reads the whole cache.
    """
    tokens = h.shape[0]
    batch, cache_len = k_cache.shape[0], k_cache.shape[2]
    new = tokens // batch
    pos = cache_len - new
    if new > 1 and pos != 0:
        # SDPA's causal mask is aligned top-left: right only for a prefill from 0.
        raise ValueError("a multi-token step must be a prefill from position 0")
    d = s.head_dim
    q, k, v = _linear(s, y, w.qkv).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
    q = q.view(batch, new, s.heads, d)
    k = k.view(batch, new, s.kv_heads, d)
    v = v.view(batch, new, s.kv_heads, d)
    c = cos.view(batch, new, 1, d)
    sn = sin.view(batch, new, 1, d)
    q = q * c + _rotate_half(q) * sn
    k = k * c + _rotate_half(k) * sn
    k_cache[:, :, pos:].copy_(k.transpose(1, 2))
    v_cache[:, :, pos:].copy_(v.transpose(1, 2))
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache,
                                          is_causal=new > 1, enable_gqa=True)
    attn = attn.transpose(1, 2).reshape(tokens, s.heads * d)
    out = funcol.all_reduce(_linear(s, attn, w.o), "sum", s.group_name)
    h = h + out
    y = _norm(s, h, w.post_norm, _in_scale(w.gate_up))
    gate, up = _linear(s, y, w.gate_up).chunk(2, dim=-1)
    out = funcol.all_reduce(_linear(s, F.silu(gate) * up, w.down), "sum", s.group_name)
    h = h + out
    return _norm(s, h, next_norm, next_in_scale), h


def _randn(shape: tuple[int, ...], seed: int, std: float, device: torch.device,
           dtype: torch.dtype, mean: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.empty(shape, device=device, dtype=torch.float32)
    t.normal_(mean, std, generator=g)
    return t.to(dtype)


def to_fp8(w: torch.Tensor, quant: str, act_range: float, keep_dequant: bool) -> FP8Linear:
    """``w`` in FP8 with one scale (``static``) or one per 128 x 128 block (``group128``);
    a static model's input scale from its calibrated range."""
    wf = w.float()
    if quant == "static":
        scale = wf.abs().amax() / FP8_MAX
        q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return FP8Linear(q, scale, torch.tensor(act_range / FP8_MAX, device=w.device), None)
    n, k = w.shape
    blocks = wf.view(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    qb = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    dequant = ((qb.float() * scale[:, None, :, None]).view(n, k).to(w.dtype)
               if keep_dequant else None)
    return FP8Linear(qb.view(n, k), scale, None, dequant)


def make_weights(cfg: ModelConfig, rank: int, world_size: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 gemm: str = "scaled_mm") -> Weights:
    """Random weights, deterministic per (seed, tensor, rank): replicated tensors
    (norms, embedding) are equal on every rank, shards differ.  An FP8 model's
    linear layers are the same random weights, quantized (``gemm`` as in
    :class:`Shard`: ``dequant`` keeps a dequantized copy for its bf16 GEMM)."""
    s = Shard.of(cfg, world_size, group_name="", gemm=gemm)
    if cfg.quant is not None and dtype != torch.bfloat16:
        raise ValueError("FP8 models compute in bfloat16")
    hd = cfg.hidden
    counter = iter(range(1, 1 << 30))

    def rand(shape: tuple[int, ...], std: float, sharded: bool, mean: float = 0.0) -> torch.Tensor:
        key = next(counter) * 1000 + (rank if sharded else 999)
        return _randn(shape, seed * 10_000_000 + key, std, device, dtype, mean)

    def norm() -> torch.Tensor:
        # Not all ones, so that a lost or misplaced weight shows in the logits.
        return rand((hd,), 0.1, sharded=False, mean=1.0)

    def linear(shape: tuple[int, int], std: float, act: str) -> Linear:
        w = rand(shape, std, sharded=True)
        if cfg.quant is None:
            return w
        return to_fp8(w, cfg.quant, ACT_RANGE[act], keep_dequant=gemm == "dequant")

    layers = []
    for _ in range(cfg.layers):
        layers.append(LayerWeights(
            input_norm=norm(),
            qkv=linear(((s.heads + 2 * s.kv_heads) * s.head_dim, hd), hd ** -0.5, "norm"),
            o=linear((hd, s.heads * s.head_dim), (cfg.heads * cfg.head_dim) ** -0.5, "attn"),
            post_norm=norm(),
            gate_up=linear((2 * s.intermediate, hd), hd ** -0.5, "norm"),
            down=linear((hd, s.intermediate), cfg.intermediate ** -0.5, "mlp")))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device,
                                                      dtype=torch.float32) / cfg.head_dim))
    return Weights(embed=rand((cfg.vocab, hd), 1.0, sharded=False), layers=layers,
                   final_norm=norm(),
                   lm_head=linear((cfg.vocab // world_size, hd), hd ** -0.5, "norm"),
                   inv_freq=inv_freq)


@dataclass
class StepInputs:
    """Everything a step reads or writes besides the weights, preallocated."""

    tokens: torch.Tensor             # [batch * new]
    positions: torch.Tensor          # [batch * new]
    k_caches: list[torch.Tensor]     # per layer [batch, kv_heads/tp, pos + new, head_dim]
    v_caches: list[torch.Tensor]


def make_inputs(cfg: ModelConfig, rank: int, world_size: int, batch: int, new: int,
                context: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                seed: int = 1) -> StepInputs:
    """Random tokens (equal on every rank) and a cache holding ``context`` random
    past tokens per sequence (per rank: they belong to this rank's heads).

    Decode: ``new=1`` at position ``context``; prefill: ``context=0``.
    """
    s = Shard.of(cfg, world_size, group_name="")
    g = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch * new,), generator=g, device=device)
    positions = (context + torch.arange(new, device=device)).repeat(batch)
    shape = (batch, s.kv_heads, context + new, cfg.head_dim)
    # The past keys and values are per rank (they come from this rank's heads).
    caches = [_randn(shape, (seed * 1000 + i) * 1000 + 10 * rank + j, 1.0, device, dtype)
              for i in range(cfg.layers) for j in range(2)]
    return StepInputs(tokens, positions, caches[0::2], caches[1::2])


LayerFn = Callable[..., tuple[Act, torch.Tensor]]
PrologueFn = Callable[..., tuple[Act, torch.Tensor, torch.Tensor, torch.Tensor]]


def step(s: Shard, w: Weights, inp: StepInputs, layer: Optional[LayerFn] = None,
         first: Optional[PrologueFn] = None, depth: Optional[int] = None) -> torch.Tensor:
    """One forward step; returns this rank's shard of the logits of each sequence's
    last token, ``[batch, vocab / tp]`` (a prefill needs no more to sample).

    ``layer`` is a compiled :func:`decoder_layer` bound to ``s``
    (``functools.partial``), ``first`` likewise for :func:`prologue`; eager when None.
    ``depth``: run only the first ``depth`` layers (0: embedding and lm_head
    alone, to time what the layers do not).
    """
    layer = layer or functools.partial(decoder_layer, s)
    first = first or functools.partial(prologue, s)
    y, h, cos, sin = first(inp.tokens, inp.positions, w.embed, w.layers[0].input_norm,
                           w.inv_freq, _in_scale(w.layers[0].qkv))
    nexts = [lw.input_norm for lw in w.layers[1:]] + [w.final_norm]
    in_scales = [_in_scale(lw.qkv) for lw in w.layers[1:]] + [_in_scale(w.lm_head)]
    for lw, nxt, nsc, kc, vc in list(zip(w.layers, nexts, in_scales, inp.k_caches,
                                         inp.v_caches))[:depth]:
        y, h = layer(lw, nxt, y, h, kc, vc, cos, sin, nsc)
    batch = inp.k_caches[0].shape[0]

    def last(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, -1, t.shape[-1])[:, -1]

    if isinstance(y, torch.Tensor):
        return _linear(s, last(y), w.lm_head)
    q, scales = y
    assert isinstance(w.lm_head, FP8Linear)
    return fp8_linear(s, (last(q).contiguous(),
                          scales if s.quant == "static" else last(scales).contiguous()), w.lm_head)


def group_name(group: Optional[dist.ProcessGroup] = None) -> str:
    return (group or dist.group.WORLD).group_name


def scaled(cfg: ModelConfig, layers: Optional[int]) -> ModelConfig:
    return cfg if layers is None else replace(cfg, layers=layers)


def group_gemm(device: torch.device) -> tuple[str, Optional[str]]:
    """``("scaled_mm", None)`` where ``torch._scaled_mm`` takes DeepSeek's 1 x 128 /
    128 x 128 scales on ``device``, eagerly and compiled, and matches the
    dequantized product; else ``("dequant", why)``."""
    if device.type != "cuda":
        return "dequant", f"torch._scaled_mm has no blockwise scaling on {device.type}"
    cfg = ModelConfig("probe", hidden=256, heads=2, kv_heads=2, head_dim=128, intermediate=256,
                      layers=1, vocab=256, quant="group128")
    s = Shard.of(cfg, 1, "", gemm="scaled_mm")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(16, 256, device=device, generator=g).to(torch.bfloat16)
    w = to_fp8(torch.randn(384, 256, device=device, generator=g).to(torch.bfloat16) / 16,
               "group128", 0.0, keep_dequant=True)
    act = quant_group(x)
    ref = fp8_linear(replace(s, gemm="dequant"), act, w).float()

    def gemm(x: torch.Tensor, w: FP8Linear) -> torch.Tensor:
        return fp8_linear(s, quant_group(x), w)

    try:
        for how, fn in (("eager", gemm), ("compiled", torch.compile(gemm, fullgraph=True))):
            err = float((fn(x, w).float() - ref).norm() / ref.norm())
            if not err < 1e-2:
                return "dequant", f"blockwise torch._scaled_mm ({how}) is off by {err:.1e}"
    except Exception as e:  # the op, its cuBLAS heuristic or Inductor's layouts refuse it
        return "dequant", f"blockwise torch._scaled_mm failed: {type(e).__name__}: {str(e)[:200]}"
    return "scaled_mm", None


def params_per_rank(cfg: ModelConfig, world_size: int) -> int:
    """Parameters one rank holds (norms aside): its shards and the replicated embedding."""
    s = Shard.of(cfg, world_size, "")
    per_layer = ((s.heads + 2 * s.kv_heads) * s.head_dim * cfg.hidden
                 + cfg.hidden * s.heads * s.head_dim + 3 * s.intermediate * cfg.hidden)
    return cfg.layers * per_layer + (cfg.vocab // world_size + cfg.vocab) * cfg.hidden


__all__ = ["CONFIGS", "FP8Linear", "LayerWeights", "ModelConfig", "Shard", "StepInputs",
           "Weights", "decoder_layer", "fp8_linear", "group_gemm", "make_inputs", "make_weights",
           "params_per_rank", "prologue", "quant_group", "quant_static", "rms_norm", "scaled",
           "step", "to_fp8", "group_name"]

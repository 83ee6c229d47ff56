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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional

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
    # Tiny: runs compiled on 2 gloo CPU ranks in seconds.
    "smoke": ModelConfig(
        "smoke", hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
        layers=2, vocab=256),
}


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

    @classmethod
    def of(cls, cfg: ModelConfig, world_size: int, group_name: str) -> "Shard":
        for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads),
                        ("intermediate", cfg.intermediate), ("vocab", cfg.vocab)):
            if n % world_size:
                raise ValueError(f"{cfg.name}: {what}={n} is not divisible by TP={world_size}")
        return cls(cfg.hidden, cfg.heads // world_size, cfg.kv_heads // world_size,
                   cfg.head_dim, cfg.intermediate // world_size, cfg.eps, group_name)


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor   # [hidden], replicated
    qkv: torch.Tensor          # [(heads + 2 kv_heads) * head_dim, hidden], this rank's heads
    o: torch.Tensor            # [hidden, heads * head_dim], this rank's input columns
    post_norm: torch.Tensor    # [hidden], replicated
    gate_up: torch.Tensor      # [2 * intermediate, hidden], this rank's rows
    down: torch.Tensor         # [hidden, intermediate], this rank's input columns


class Weights(NamedTuple):
    embed: torch.Tensor        # [vocab, hidden], replicated
    layers: list[LayerWeights]
    final_norm: torch.Tensor   # [hidden], replicated
    lm_head: torch.Tensor      # [vocab / tp, hidden], this rank's vocab rows
    inv_freq: torch.Tensor     # [head_dim / 2], fp32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward, verbatim in behaviour."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def prologue(s: Shard, tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
             norm: torch.Tensor, inv_freq: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embedding, the first layer's input norm and the rotary table: (y, h, cos, sin)."""
    h = F.embedding(tokens, embed)
    cos, sin = rope_cos_sin(positions, inv_freq, h.dtype)
    return rms_norm(h, norm, s.eps), h, cos, sin


def decoder_layer(s: Shard, w: LayerWeights, next_norm: torch.Tensor, y: torch.Tensor,
                  h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer from its normed input ``y`` and residual ``h`` to the next layer's (y, h).

    ``y, h``: ``[batch * new, hidden]``; the new tokens' keys and values are
    written at the end of the caches, and attention reads the whole cache.
    """
    tokens = y.shape[0]
    batch, cache_len = k_cache.shape[0], k_cache.shape[2]
    new = tokens // batch
    pos = cache_len - new
    if new > 1 and pos != 0:
        # SDPA's causal mask is aligned top-left: right only for a prefill from 0.
        raise ValueError("a multi-token step must be a prefill from position 0")
    d = s.head_dim
    q, k, v = F.linear(y, w.qkv).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
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
    out = funcol.all_reduce(F.linear(attn, w.o), "sum", s.group_name)
    h = h + out
    y = rms_norm(h, w.post_norm, s.eps)
    gate, up = F.linear(y, w.gate_up).chunk(2, dim=-1)
    out = funcol.all_reduce(F.linear(F.silu(gate) * up, w.down), "sum", s.group_name)
    h = h + out
    return rms_norm(h, next_norm, s.eps), h


def _randn(shape: tuple[int, ...], seed: int, std: float, device: torch.device,
           dtype: torch.dtype, mean: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.empty(shape, device=device, dtype=torch.float32)
    t.normal_(mean, std, generator=g)
    return t.to(dtype)


def make_weights(cfg: ModelConfig, rank: int, world_size: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Weights:
    """Random weights, deterministic per (seed, tensor, rank): replicated tensors
    (norms, embedding) are equal on every rank, shards differ."""
    s = Shard.of(cfg, world_size, group_name="")
    hd = cfg.hidden
    counter = iter(range(1, 1 << 30))

    def rand(shape: tuple[int, ...], std: float, sharded: bool, mean: float = 0.0) -> torch.Tensor:
        key = next(counter) * 1000 + (rank if sharded else 999)
        return _randn(shape, seed * 10_000_000 + key, std, device, dtype, mean)

    def norm() -> torch.Tensor:
        # Not all ones, so that a lost or misplaced weight shows in the logits.
        return rand((hd,), 0.1, sharded=False, mean=1.0)

    layers = []
    for _ in range(cfg.layers):
        layers.append(LayerWeights(
            input_norm=norm(),
            qkv=rand(((s.heads + 2 * s.kv_heads) * s.head_dim, hd), hd ** -0.5, True),
            o=rand((hd, s.heads * s.head_dim), (cfg.heads * cfg.head_dim) ** -0.5, True),
            post_norm=norm(),
            gate_up=rand((2 * s.intermediate, hd), hd ** -0.5, True),
            down=rand((hd, s.intermediate), cfg.intermediate ** -0.5, True)))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device,
                                                      dtype=torch.float32) / cfg.head_dim))
    return Weights(embed=rand((cfg.vocab, hd), 1.0, sharded=False), layers=layers,
                   final_norm=norm(),
                   lm_head=rand((cfg.vocab // world_size, hd), hd ** -0.5, True),
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


LayerFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PrologueFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


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
                           w.inv_freq)
    nexts = [lw.input_norm for lw in w.layers[1:]] + [w.final_norm]
    for lw, nxt, kc, vc in list(zip(w.layers, nexts, inp.k_caches, inp.v_caches))[:depth]:
        y, h = layer(lw, nxt, y, h, kc, vc, cos, sin)
    batch = inp.k_caches[0].shape[0]
    return F.linear(y.view(batch, -1, y.shape[-1])[:, -1], w.lm_head)


def group_name(group: Optional[dist.ProcessGroup] = None) -> str:
    return (group or dist.group.WORLD).group_name


def scaled(cfg: ModelConfig, layers: Optional[int]) -> ModelConfig:
    return cfg if layers is None else replace(cfg, layers=layers)


def params_per_rank(cfg: ModelConfig, world_size: int) -> int:
    """Parameters one rank holds (norms aside): its shards and the replicated embedding."""
    s = Shard.of(cfg, world_size, "")
    per_layer = ((s.heads + 2 * s.kv_heads) * s.head_dim * cfg.hidden
                 + cfg.hidden * s.heads * s.head_dim + 3 * s.intermediate * cfg.hidden)
    return cfg.layers * per_layer + (cfg.vocab // world_size + cfg.vocab) * cfg.hidden


__all__ = ["CONFIGS", "LayerWeights", "ModelConfig", "Shard", "StepInputs", "Weights",
           "decoder_layer", "make_inputs", "make_weights", "params_per_rank", "prologue",
           "rms_norm", "scaled", "step", "group_name"]

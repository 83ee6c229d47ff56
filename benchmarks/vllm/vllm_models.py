"""The models the vLLM benchmarks run (real shapes, dummy weights) and what their weights and
KV cache take per GPU.  Only the model's description: no vLLM, so that the memory plan
(``wave_plan.py``) reads it in a second or two before any engine starts."""

from __future__ import annotations

from typing import Optional

from fusion_pass.tools import demo
from fusion_pass.tools.demo import ModelSpec

MODELS = {m.name: m for m in (
    ModelSpec("llama3-8b-like", hidden=4096, layers=32, intermediate=14336, heads=32,
              kv_heads=8, head_dim=128, vocab=128256),
    # GPT-OSS-120B's work per decoded token on a dense Llama: its hidden size, layer count,
    # attention shape and vocabulary, and an MLP as wide as the four experts a token runs
    # (4 x 2880; GPT-OSS's own layers are MoE, its experts' weights MXFP4: the stand-in has
    # its active parameters, in bfloat16, not its bytes).  10.6 GiB of weights, so that a
    # decode step is longer than the host's part of it at TP=1.
    ModelSpec("gptoss-active-h2880", hidden=2880, layers=36, intermediate=4 * 2880,
              heads=64, kv_heads=8, head_dim=64, vocab=201088),
    # GPT-OSS's hidden size with one expert's MLP width (4.5 GiB): its decode step is bound
    # by the host (docs/vllm_benchmark.md, section 4); the placement probe's model.
    ModelSpec("dense-h2880", hidden=2880, layers=24, intermediate=2880, heads=64,
              kv_heads=8, head_dim=64, vocab=201088),
    ModelSpec("tiny", hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2,
              head_dim=64, vocab=512),
    *demo.MODELS,
)}
GPU_MODELS = ("llama3-8b-like", "gptoss-active-h2880")
CPU_MODELS = ("tiny",)

STEP_TOKENS = 8192
"""A GPU engine's token budget a step (vLLM's ``max_num_batched_tokens``) where its model
names none of its own (:data:`MODEL_STEP_TOKENS`): vLLM's own default for a server on a GPU
of 70 GiB or more.  A wave of requests at concurrency 8 (8000 tokens) is one prefill step,
so no prefill lands in a request's decode.  At 2048 the wave took four steps, and whether
the first ones' tokens reached the clients at each step's end or a step later was settled
run by run: median TPOT at 8 took one of two values 6 % apart for the GPT-OSS stand-in,
and for the 8B-like model moved with the first tokens' times by up to 6 % a run
(docs/vllm_benchmark.md, section 9)."""
MODEL_STEP_TOKENS: dict[str, int] = {}
"""A model's own budget, where it differs from :data:`STEP_TOKENS` (none does now)."""


def step_tokens(model: str, given: Optional[int] = None) -> int:
    """``model``'s token budget a step on GPUs: ``given`` where set (a run's
    ``--max-num-batched-tokens``, every model alike), else (None) the model's own."""
    return given if given is not None else MODEL_STEP_TOKENS.get(model, STEP_TOKENS)


WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the engines' dtypes."""
VOCAB_PADDING = 64
"""vLLM pads a vocabulary to a multiple of this before splitting it over the ranks
(``DEFAULT_VOCAB_PADDING_SIZE`` of its vocab-parallel embedding)."""
SEGMENT = 2 << 20
"""The caching allocator's large segments: every weight tensor takes a whole number of them.
It is why vLLM logs 10.81 GiB for the GPT-OSS stand-in's weights (10.61 GiB of parameters)
and 4.55 GiB for dense-h2880's (4.46), and exactly the parameters for the 8B-like model,
whose tensors are multiples of 2 MiB (``Model loading took``, the runs' logs)."""


def kv_bytes_per_token(spec: ModelSpec, tp: int, dtype: str) -> int:
    """KV cache bytes per token on one rank: K and V of every layer, the KV heads split
    over the ranks (replicated where there are fewer heads than ranks)."""
    return spec.layers * 2 * max(spec.kv_heads // tp, 1) * spec.head_dim * WIDTH[dtype]


def weight_bytes(spec: ModelSpec, tp: int, dtype: str) -> int:
    """The weights one rank holds, as vLLM's Llama lays them out: the vocab-parallel
    embedding and LM head (untied), per layer the fused QKV and gate-up projections split
    by columns, the output and down projections by rows, two norms, and the final norm;
    each tensor rounded up to the allocator's segments (:data:`SEGMENT`)."""
    width = WIDTH[dtype]
    kv = max(spec.kv_heads // tp, 1)
    q = spec.heads // tp
    vocab = -(-spec.vocab // (VOCAB_PADDING * tp)) * VOCAB_PADDING

    def tensor(*dims: int) -> int:
        n = width
        for d in dims:
            n *= d
        return n if n < SEGMENT else -(-n // SEGMENT) * SEGMENT

    layer = (tensor(spec.hidden, (q + 2 * kv) * spec.head_dim)
             + tensor(q * spec.head_dim, spec.hidden)
             + tensor(spec.hidden, 2 * spec.intermediate // tp)
             + tensor(spec.intermediate // tp, spec.hidden)
             + 2 * tensor(spec.hidden))
    return 2 * tensor(vocab, spec.hidden) + spec.layers * layer + tensor(spec.hidden)

"""A small TP=2 model compiled with the pass under depyf: a real dump to inspect.

Used by the graph-dump notebook and the inspection tests; runs on CPU gloo ranks.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import records as _records
from .spawn import run_ranks

class TinyTPModel(torch.nn.Module):
    """Row-parallel MLP blocks, each followed by all-reduce, residual add and an
    HF-style RMSNorm: the layer pattern of a tensor-parallel decoder, on one rank."""

    def __init__(self, hidden: int, ffn: int, world_size: int, rank: int, group: str,
                 layers: int = 2, eps: float = 1e-6) -> None:
        super().__init__()
        shard = ffn // world_size
        self.group, self.eps = group, eps
        # Drawn in full and sliced, so that every rank holds a shard of one model.
        up = [torch.randn(ffn, hidden) / hidden ** 0.5 for _ in range(layers)]
        down = [torch.randn(hidden, ffn) / ffn ** 0.5 for _ in range(layers)]
        self.up = torch.nn.ParameterList(w[rank * shard:(rank + 1) * shard] for w in up)
        self.down = torch.nn.ParameterList(w[:, rank * shard:(rank + 1) * shard] for w in down)
        self.norm = torch.nn.ParameterList(1 + 0.1 * torch.randn(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch.distributed._functional_collectives as fc

        h = x
        for up, down, w in zip(self.up, self.down, self.norm):
            part = torch.nn.functional.silu(x @ up.t()) @ down.t()
            reduced = fc.all_reduce(part, "sum", self.group)
            h = reduced + h
            hf = h.float()
            y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
            x = (w * y.to(w.dtype)).to(h.dtype)
        # The last block's sum, also returned (say, for an activation statistic): a
        # value the fused op cannot hand out, so that site is left alone with its reason.
        return x, h, reduced


EXAMPLE_CALLS = ((4, None), (200, (96, 4096)), (7, (2, 1024)))
"""(tokens, dynamic range or None) per call: a static 4-token compile (one-stage),
a range compile above the threshold (two-stage), one straddling it (runtime)."""


def _example_rank(rank: int, world_size: int, out_dir: str, hidden: int,
                  calls: list[tuple[int, Optional[tuple[int, int]]]]) -> list[float]:
    import torch.distributed as dist
    from torch._inductor import config

    from ..allreduce_rmsnorm_pass import AllReduceRMSNormFusionPass
    from ..depyf_dump import dump

    torch.manual_seed(0)  # the same full weights on every rank
    model = TinyTPModel(hidden, 2 * hidden, world_size, rank, dist.group.WORLD.group_name)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    # An fp32 norm weight in a bf16 model (Llama style): fused, reading the weight in fp32.
    model.norm[0].data = model.norm[0].data.float()
    config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
    errors = []
    with dump(os.path.join(out_dir, f"rank_{rank}_dp_0")):
        compiled = torch.compile(model)
        for tokens, dyn in calls:
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
            x = x.to(torch.bfloat16)
            if dyn is not None:
                torch._dynamo.mark_dynamic(x, 0, min=dyn[0], max=dyn[1])
            got, want = compiled(x), model(x)
            errors.append(max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want)))
    return errors


def make_example_dump(out_dir: str, hidden: int = 256, world_size: int = 2,
                      calls: tuple = EXAMPLE_CALLS, timeout: float = 600) -> list[list[float]]:
    """Compile :class:`TinyTPModel` on ``world_size`` gloo CPU ranks under depyf
    into ``out_dir`` (``rank_<r>_dp_0/``), with the pass's records next to it.

    Returns each rank's per-call max abs difference between the compiled and
    the eager model.
    """
    out = os.path.abspath(out_dir)
    os.makedirs(out, exist_ok=True)
    env = {_records.RECORD_DIR_ENV: out,
           # A graph-cache hit would skip the pass and dump nothing; the
           # compiled-kernel cache stays on, it keeps reruns fast.
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    return run_ranks(_example_rank, world_size, out, hidden, list(calls), env=env, timeout=timeout)

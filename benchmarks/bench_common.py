"""Pieces the benchmarks share: the op's fallback warnings, a relative error, and the
worst of a check over the ranks."""

from __future__ import annotations

import logging

import torch


class Fallbacks(logging.Handler):
    """Collects the op's "falls back to the reference" warnings (said once per shape class)
    while attached to the ``fusion_pass`` logger: a fused column that fell back measured
    the reference, not a fused kernel."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "falls back" in msg or "runs separately" in msg:
            self.messages.append(msg)

    def __enter__(self) -> "Fallbacks":
        logging.getLogger("fusion_pass").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("fusion_pass").removeHandler(self)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """``||a - b|| / ||b||`` (``rel_l2``) and ``max|a - b| / max|b|`` (``max_rel``), in fp32."""
    a, b = a.float(), b.float()
    d = a - b
    return {"rel_l2": float(d.norm() / b.norm().clamp_min(1e-30)),
            "max_rel": float(d.abs().max() / b.abs().max().clamp_min(1e-30))}


def worst_over_ranks(checks: dict[str, float]) -> dict[str, float]:
    """Each number of ``checks`` at its largest over the default group's ranks (a
    collective: every rank calls it with the same keys).  One rank's check misses
    the wrong rows that only another rank holds; the recorded number is the worst."""
    import torch.distributed as dist

    keys = sorted(checks)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(checks[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: type(checks[k])(v) for k, v in zip(keys, t.tolist())}

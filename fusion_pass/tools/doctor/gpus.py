"""The GPU section: the visible GPUs, which pairs can reach each other, NVLink, whether a
group of the asked TP size can use torch symmetric memory here, and programmatic dependent
launch.  GPU facts come from :mod:`fusion_pass.topology` (:meth:`Context.gpus`)."""

from __future__ import annotations

import itertools
import os
from typing import Any

from .context import Context
from .findings import Finding, no, ok, skip

GIB = 1 << 30


def _capability(gpu: Any) -> str:
    cap = gpu.capability
    if isinstance(cap, (tuple, list)) and len(cap) >= 2:
        return f"{cap[0]}.{cap[1]}"
    return str(cap)


def _describe(gpu: Any) -> str:
    return f"{gpu.name} (sm {_capability(gpu)}, {gpu.sms} SMs, {gpu.total_bytes / GIB:.1f} GiB)"


def _span(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out = []
    for _, run in itertools.groupby(enumerate(indices), lambda p: p[1] - p[0]):
        vals = [v for _, v in run]
        out.append(str(vals[0]) if len(vals) == 1 else f"{vals[0]}-{vals[-1]}")
    return ", ".join(out)


def _no_gpu_reason() -> str:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        return f"torch {torch.__version__} is a CPU build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return "CUDA_VISIBLE_DEVICES is empty"
    return "torch sees no GPU (no driver, or none visible)"


def devices(ctx: Context) -> Finding:
    gpus = ctx.gpus()
    if not gpus:
        return no("GPUs", f"none: {_no_gpu_reason()}", count=0, gpus=[])
    data = [dict(index=g.index, name=g.name, uuid=str(g.uuid), capability=_capability(g),
                 sms=g.sms, total_bytes=g.total_bytes) for g in gpus]
    groups: dict[str, list[int]] = {}
    for g in gpus:
        groups.setdefault(_describe(g), []).append(int(g.index))
    text = "; ".join(f"{len(ix)} x {d}: GPU {_span(ix)}" for d, ix in groups.items())
    return ok(f"GPUs: {text}", count=len(gpus), gpus=data)


def p2p(ctx: Context) -> Finding:
    gpus = ctx.gpus()
    if len(gpus) < 2:
        return skip("P2P", "no pair of GPUs" if gpus else "no GPU", matrix=[])
    matrix = [[bool(x) for x in row] for row in ctx.topology().p2p_matrix()]
    n = len(matrix)
    missing = [f"{i}-{j}" for i in range(n) for j in range(i + 1, n)
               if not (matrix[i][j] and matrix[j][i])]
    if missing:
        return no("P2P", f"GPU pairs {', '.join(missing)} cannot access each other's memory",
                  matrix=matrix)
    return ok(f"P2P: every pair of the {n} GPUs can access each other's memory", matrix=matrix)


def nvlink(ctx: Context) -> Finding:
    """Active NVLink links per GPU, through NVML (``pynvml``, from nvidia-ml-py), where
    installed; optional."""
    gpus = ctx.gpus()
    if len(gpus) < 2:
        return skip("NVLink", "no pair of GPUs" if gpus else "no GPU", links=[])
    import torch

    if torch.version.hip is not None:
        return skip("NVLink", "ROCm GPUs (xGMI is not read here)", links=[])
    try:
        import pynvml
    except ImportError:
        return skip("NVLink", "pynvml is not installed (pip install nvidia-ml-py to read it)",
                    links=[])
    pynvml.nvmlInit()
    try:
        links = [_active_links(pynvml, g) for g in gpus]
    finally:
        pynvml.nvmlShutdown()
    if not any(links):
        return no("NVLink", "no active link: GPU pairs talk over PCIe", links=links)
    per = sorted(set(links))
    text = (f"{per[0]} active links per GPU" if len(per) == 1
            else ", ".join(f"GPU {g.index}: {n}" for g, n in zip(gpus, links)) + " active links")
    return ok(f"NVLink: {text}", links=links)


def _active_links(pynvml: Any, gpu: Any) -> int:
    uuid = str(gpu.uuid)
    handle = None
    for name in (uuid, f"GPU-{uuid}"):
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            break
        except pynvml.NVMLError:
            continue
    if handle is None:  # the index is NVML's only where CUDA_VISIBLE_DEVICES renumbers nothing
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(gpu.index))
    active = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                active += 1
        except pynvml.NVMLError:  # no such link, or no NVLink on this GPU
            break
    return active


def symmetric_memory(ctx: Context) -> Finding:
    """Whether a TP group of the asked size, one rank per visible GPU in order (ranks beyond
    the GPUs share them), would get torch symmetric memory: the topology's
    ``group_decline`` over each rank's ``local_facts``."""
    import torch

    tp = ctx.tp
    label = f"symmetric memory (TP {tp})"
    if tp < 2:
        return skip(label, f"TP {tp}: no group", tp=tp)
    if not torch.distributed.is_available():
        return no(label, "torch.distributed is not available in this torch build", tp=tp)
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return no(label, f"torch.distributed._symmetric_memory does not import ({e})", tp=tp)
    gpus = ctx.gpus()
    if not gpus:
        return no(label, "no GPU", tp=tp)
    topology = ctx.topology()
    devices = [int(gpus[r % len(gpus)].index) for r in range(tp)]
    why = topology.group_decline([topology.local_facts(d) for d in devices])
    if why is not None:
        return no(label, why, tp=tp, devices=devices)
    return ok(f"{label}: ranks on GPU {_span(sorted(set(devices)))} can map each other's "
              "buffers", tp=tp, devices=devices)


def pdl(ctx: Context) -> Finding:
    """Programmatic dependent launch, by the Triton backend's own rule per GPU."""
    from ...backends.triton_symm.environment import pdl_enabled

    indices = ctx.gpu_indices()
    if not indices:
        return skip("PDL", "no GPU", enabled=[])
    enabled = [pdl_enabled(i) for i in indices]
    if all(enabled):
        return ok("PDL: on (Hopper or newer; FUSION_PASS_PDL=0 turns it off)", enabled=enabled)
    off = [i for i, e in zip(indices, enabled) if not e]
    why = ("FUSION_PASS_PDL=0" if os.environ.get("FUSION_PASS_PDL", "1") == "0" else
           f"GPU {_span(off)} older than Hopper (sm 9.0): no griddepcontrol")
    return no("PDL", f"off: {why}", enabled=enabled)

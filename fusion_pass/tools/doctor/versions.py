"""The versions section: Python, this package, torch, Triton and its kernel launcher, vLLM,
AITER and depyf, each with what the fusion makes of it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any, Optional

from .context import Context
from .findings import Finding, no, ok, skip

DIST = "fusion_pass"


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def python(ctx: Context) -> Finding:
    return ok(f"Python {platform.python_version()}", version=platform.python_version())


def fusion_pass(ctx: Context) -> Finding:
    import fusion_pass as package

    where = os.path.dirname(os.path.abspath(package.__file__))
    version = _dist_version(DIST)
    if version is None:
        return no("fusion_pass", f"imported from {where} but not installed, so vLLM finds no "
                  "plugin entry point (pip install -e .)", version=None, path=where)
    return ok(f"fusion_pass {version}", version=version, path=where)


def torch(ctx: Context) -> Finding:
    import torch as t

    cuda, hip = t.version.cuda, t.version.hip
    build = f"HIP {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU build: no CUDA, no HIP"
    return ok(f"torch {t.__version__} ({build})", version=t.__version__, cuda=cuda, hip=hip)


def triton(ctx: Context) -> Finding:
    if importlib.util.find_spec("triton") is None:
        if ctx.has_gpu() and _is_cuda_build():
            return no("Triton", "not installed: the CUDA backend's kernels are Triton kernels",
                      version=None)
        return skip("Triton", "not installed (only GPUs need it)", version=None)
    import triton as tr

    version = str(getattr(tr, "__version__", "unknown"))
    if _interpreting():
        return ok(f"Triton {version} (TRITON_INTERPRET=1: kernels run in its interpreter, "
                  "on the CPU)", version=version, interpreter=True)
    return ok(f"Triton {version}", version=version, interpreter=False)


def triton_launcher(ctx: Context) -> Finding:
    """Whether the fast launch knows this Triton's launcher: read from a compiled kernel
    (the backend's own buffer probe), as the backend reads it at its first launch."""
    from ...backends.triton_symm import launch

    known = [g.name for g in launch.GENERATIONS]
    label = "Triton launcher"
    if importlib.util.find_spec("triton") is None:
        return skip(label, "Triton is not installed", known=known, generation=None)
    if _interpreting():
        return skip(label, "TRITON_INTERPRET=1: no compiled kernel, no launcher", known=known,
                    generation=None)
    import torch as t

    if not ctx.has_gpu() or not t.cuda.is_available():
        return skip(label, f"no GPU: its generation (known: {', '.join(known)}) is read from "
                    "the first kernel compiled", known=known, generation=None)
    run = _compiled_launcher()
    gen = launch.generation(run)
    kind = f"{type(run).__module__}.{type(run).__qualname__}"
    if gen is None:
        return no(label, f"{kind} calls its C function in a layout the fast path does not know "
                  f"({', '.join(known)}): the kernels launch through kernel[grid] (correct, "
                  "slower on the host)", known=known, generation=None, launcher=kind)
    unfit = launch._unfit(run)
    if unfit is not None:
        return no(label, f"generation {gen.name}, but {unfit}", known=known,
                  generation=gen.name, launcher=kind)
    return ok(f"Triton launcher: generation {gen.name}, the fast launch takes it",
              known=known, generation=gen.name, launcher=kind)


def _compiled_launcher() -> Any:
    """``CompiledKernel.run`` of the backend's buffer probe, compiled (not launched) for GPU 0."""
    import torch as t

    from ...backends.triton_symm.probe import read_ends_kernel

    peers = t.zeros(1, dtype=t.int64, device="cuda:0")
    out = t.empty(2, dtype=t.bfloat16, device="cuda:0")
    kernel = read_ends_kernel.warmup(peers, out, 1, grid=(1,))
    kernel = kernel.result() if hasattr(kernel, "result") else kernel
    return kernel.run


def vllm(ctx: Context) -> Finding:
    from ... import vllm_names

    supported = vllm_names.supported_text()
    try:
        module = ctx.vllm()
    except Exception as e:  # installed, and broken on import
        return no("vLLM", f"installed but does not import ({type(e).__name__}: {e})",
                  version=_dist_version("vllm"), supported=supported)
    if module is None:
        return skip("vLLM", "not installed (the plugin is for vLLM; plain torch.compile needs "
                    "none)", version=None, supported=supported)
    compat = ctx.compat()
    version = compat.vllm_version()
    reason = compat.unsupported_reason()
    if reason is not None:
        return no("vLLM", reason, version=version, supported=supported)
    return ok(f"vLLM {version} (supported: {supported})", version=version, supported=supported)


def aiter(ctx: Context) -> Finding:
    from ...backends.aiter import installed, limits_for_version

    version = installed.version()
    if version is None:
        return skip("AITER", "not installed (ROCm only)", version=None, declined={})
    import torch as t

    off = dict(limits_for_version(version).off)
    declined = {p.value: why for p, why in off.items()}
    note = "" if t.version.hip else " (unused: torch is no ROCm build)"
    if declined:
        paths = ", ".join(sorted(declined))
        return no(f"AITER {version}{note}", f"the aiter backend declines {paths}: "
                  f"{'; '.join(dict.fromkeys(declined.values()))}", version=version,
                  declined=declined)
    return ok(f"AITER {version}{note}: both fused paths", version=version, declined={})


def depyf(ctx: Context) -> Finding:
    version = _dist_version("depyf")
    if version is None:
        return skip("depyf", "not installed (graph dumps need it)", version=None)
    return ok(f"depyf {version}", version=version)


def _is_cuda_build() -> bool:
    import torch as t

    return t.version.hip is None


def _interpreting() -> bool:
    """Triton's own reading of ``TRITON_INTERPRET`` where Triton imports."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # no Triton, or one without knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

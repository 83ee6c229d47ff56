"""Launching a Triton kernel at the cost of one C call.

``JITFunction.__getitem__(grid)(...)`` binds the arguments, builds a
specialization key and looks the compiled kernel up on every call (tens of
microseconds of Python).  A :class:`Launcher` does that once: the first call
compiles through ``JITFunction.warmup`` and keeps the ``CompiledKernel``'s
C launcher (Triton 3.x: ``CompiledKernel.run.launch``); later calls pass the
stream, the kernel handle and the arguments straight to it.

The compiled kernel is specialized on what the arguments were at warm-up:
16-byte alignment of the pointers, integers equal to 1.  The per-call
pointers are checked for alignment (:meth:`Launcher.__call__`'s caller passes
``aligned``); everything else a plan passes is fixed for the plan's life.
Anything unexpected (another Triton, the interpreter, profiling hooks) keeps
the ordinary ``kernel[grid](...)`` path, which is always correct.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ...log import once


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class Launcher:
    """One kernel, one grid, fixed trailing arguments and constexprs.

    ``values`` holds every parameter after the per-call ones ``per_call`` (the
    plan's tensors stay alive with the plan that owns them).  The fast path
    passes them in the kernel's parameter order, constexprs included: Triton's
    C launcher takes and ignores those.
    """

    __slots__ = ("fn", "grid", "tail", "runtime_tail", "constexprs", "options", "_fast", "_pre",
                 "_tried")

    def __init__(self, fn: Any, grid: int, per_call: tuple[str, ...], values: dict[str, Any],
                 options: dict[str, Any]) -> None:
        names = list(fn.arg_names)
        if tuple(names[:len(per_call)]) != per_call:
            raise AssertionError(f"{fn}: parameters {names[:len(per_call)]} are not {per_call}")
        rest = names[len(per_call):]
        constexpr_names = {p.name for p in getattr(fn, "params", ()) if p.is_constexpr}
        if not constexpr_names:  # the interpreter's function has no params: read the annotations
            ann = getattr(getattr(fn, "fn", fn), "__annotations__", {})
            constexpr_names = {k for k, v in ann.items() if "constexpr" in str(v)}
        self.fn, self.grid, self.options = fn, grid, options
        # The C launcher takes a pointer as an int too, which skips its data_ptr()
        # call and pointer-attribute query for the arguments fixed by the plan.
        self.tail = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v
                          for v in (values[k] for k in rest))
        self.runtime_tail = tuple(values[k] for k in rest if k not in constexpr_names)
        self.constexprs = {k: values[k] for k in rest if k in constexpr_names}
        self._fast: Optional[Callable] = None
        self._pre: tuple = ()
        self._tried = False

    @property
    def ready(self) -> bool:
        """Whether :meth:`launch_addresses` may be used."""
        return self._fast is not None

    def launch_addresses(self, device: int, head: tuple) -> None:
        """Launch on the current stream, the per-call arguments given as they
        reach the kernel: addresses for tensors (0 for an unused pointer),
        numbers.  An address skips the C launcher's ``data_ptr()`` call and its
        CUDA pointer-attribute query: microseconds per call over nine pointers."""
        self._fast(self.grid, 1, 1, _stream(device), *self._pre, *head, *self.tail)

    def __call__(self, device: int, head: tuple, aligned: bool) -> None:
        """Launch with the per-call arguments ``head`` (tensors) on the current stream."""
        if self._fast is None and not self._tried and aligned:
            self._tried = True
            try:
                self._prepare(head)
            except (ImportError, AttributeError, TypeError) as e:  # another Triton's internals
                once(f"triton-launcher:{type(e).__name__}",
                     f"fusion_pass: Triton's C launcher is not reachable here ({e!r}); the "
                     "kernels launch through kernel[grid] (correct, slower on the host)",
                     logging.INFO)
        if self._fast is not None and aligned:
            self._fast(self.grid, 1, 1, _stream(device), *self._pre, *head, *self.tail)
            return
        self.fn[(self.grid,)](*head, *self.runtime_tail, **self.constexprs, **self.options)

    def _prepare(self, head: tuple) -> None:
        """Compile (or find) the kernel for these arguments and keep its C launcher."""
        from triton import knobs

        hook = knobs.runtime.launch_enter_hook  # a HookChain in Triton 3.6, None in older ones
        if knobs.runtime.interpret or (hook is not None and getattr(hook, "calls", True)):
            return
        warmup = getattr(self.fn, "warmup", None)
        if warmup is None:
            return
        kernel = warmup(*head, *self.runtime_tail, grid=(self.grid,), **self.constexprs,
                        **self.options)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        launcher = getattr(kernel, "run", None)
        launch = getattr(launcher, "launch", None)
        if launch is None or getattr(launcher, "global_scratch_size", 1) \
                or getattr(launcher, "profile_scratch_size", 1):
            return
        # cuLaunchKernelEx's header: handle, cooperative, PDL, the two scratch
        # buffers (none), metadata, launch metadata and the two hooks (none).
        self._pre = (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                     None, None, kernel.packed_metadata, None, None, None)
        self._fast = launch

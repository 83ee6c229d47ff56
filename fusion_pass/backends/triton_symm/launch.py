"""Launching a Triton kernel at the cost of one C call.

``JITFunction.__getitem__(grid)(...)`` binds the arguments, builds a
specialization key and looks the compiled kernel up on every call (tens of
microseconds of Python).  A :class:`Launcher` does that once: the first call
compiles through ``JITFunction.warmup`` and keeps the ``CompiledKernel``'s C
launch function (``CompiledKernel.run.launch``); later calls pass the stream,
the kernel handle and the arguments straight to it.

That C function's arguments changed between Triton releases.  Each layout the
fast path knows is a :class:`Generation`:

- ``flat`` (Triton 3.6): a C function generated per kernel, the kernel's
  arguments flat after a header of 13 (grid, stream, handle, cooperative, PDL,
  the two scratch buffers, metadata, launch metadata, the two hooks);
- ``generic`` (Triton 3.8 and 3.9): one C function for every kernel, 16
  arguments, the scratch buffers after the hooks, then the argument
  annotations and signature bytes the compiled kernel made, then the kernel's
  arguments as one tuple.

Which one a compiled kernel has is read from the kernel itself, not from a
version number (:func:`generation`): its launcher object is asked to launch
with its C function swapped for a recorder, and the call it makes is compared
with what each generation's packing makes of the same arguments.  Both pass
constexprs in their place (the C side skips them) and take pointers as
integers.

The compiled kernel is specialized on what the arguments were at warm-up:
16-byte alignment of the pointers, integers equal to 1.  The per-call
pointers are checked for alignment (:meth:`Launcher.__call__`'s caller passes
``aligned``); everything else a plan passes is fixed for the plan's life.
Anything else keeps the ordinary ``kernel[grid](...)`` path, which is always
correct: the interpreter, launch hooks (profilers), a kernel that needs
scratch memory or runs instrumented, a launcher of a generation not listed
here, or any exception from the first fast call.  Triton's C launch function
raises before it launches or instead of launching (its argument parsing, the
driver refusing the launch; the exit hook, the one step after a launch, is
None here), so after an exception nothing ran: ``kernel[grid]`` then
launches the call, and raises itself an error that is not the fast path's
(a lost CUDA context, say).  Each of those is said once per process, with
the Triton version.  Once a launcher's first fast call went through, its later
calls are not guarded (the hot path pays nothing for it).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, NamedTuple, Optional

import torch

from ...log import once


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "(not importable)"
    return str(getattr(triton, "__version__", "(no version)"))


# ------------------------------------------------------------ the generations

def _flat_header(run: Any, function: Any, metadata: Any) -> tuple:
    # Triton 3.6's per-kernel launch(): handle, cooperative, PDL, global and
    # profile scratch (none), kernel metadata, launch metadata and the two
    # hooks (none), then the kernel's arguments.
    return (function, run.launch_cooperative_grid, run.launch_pdl, None, None, metadata,
            None, None, None)


def _flat_call(launch: Callable, grid: int, stream: int, pre: tuple, head: tuple,
               tail: tuple) -> None:
    launch(grid, 1, 1, stream, *pre, *head, *tail)


def _generic_header(run: Any, function: Any, metadata: Any) -> tuple:
    # Triton 3.8's launch(): handle, cooperative, PDL, kernel metadata, launch
    # metadata and the two hooks (none), global and profile scratch (none),
    # the kernel's argument annotations and signature bytes, then its
    # arguments as one tuple.
    return (function, run.launch_cooperative_grid, run.launch_pdl, metadata, None, None, None,
            None, None, run.arg_annotations, run.kernel_signature)


def _generic_call(launch: Callable, grid: int, stream: int, pre: tuple, head: tuple,
                  tail: tuple) -> None:
    launch(grid, 1, 1, stream, *pre, (*head, *tail))


class Generation(NamedTuple):
    """One layout of the C launch function's arguments."""

    name: str
    header: Callable[[Any, Any, Any], tuple]
    """``(launcher, kernel handle, packed metadata)`` -> the arguments
    between the stream and the kernel's own."""
    call: Callable[..., None]
    """``(launch, grid, stream, header, head, tail)``: one launch."""


GENERATIONS = (Generation("flat", _flat_header, _flat_call),
               Generation("generic", _generic_header, _generic_call))
"""The layouts the fast path knows, tried in this order."""


class _Mark:
    """A stand-in argument of the probe: equal to itself alone, and of no type
    a C launch function would accept (the probe never launches)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def generation(run: Any) -> Optional[Generation]:
    """The generation of a compiled kernel's launcher ``CompiledKernel.run``,
    or None when its call matches none of :data:`GENERATIONS`.

    A shallow copy of ``run`` is called the way ``JITFunction.run`` calls it
    (grid, stream, handle, metadata, launch metadata, hooks, the arguments)
    with its ``launch`` replaced by a recorder; a generation is the one whose
    packing of the same values gives the same positional arguments.  Only a
    launcher without scratch memory may be probed (its own call would
    allocate that)."""
    if getattr(run, "launch", None) is None:
        return None
    calls: list = []

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))

    function, metadata = _Mark("function"), _Mark("kernel metadata")
    head, tail = (_Mark("arg 0"), _Mark("arg 1")), (_Mark("arg 2"),)
    grid, stream = 7, 5
    try:
        probe = copy.copy(run)
        probe.launch = record
        probe(grid, 1, 1, stream, function, metadata, None, None, None, *head, *tail)
    except Exception:  # a launcher that cannot be called so: not a known one
        return None
    if len(calls) != 1 or calls[0][1]:
        return None
    for gen in GENERATIONS:
        try:
            pre = gen.header(run, function, metadata)
        except AttributeError:  # the launcher lacks what this generation reads
            continue
        mine: list = []
        gen.call(lambda *args: mine.append(args), grid, stream, pre, head, tail)
        if _same(mine[0], calls[0][0]):
            return gen
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal argument lists: tuples element by element (a list is not a tuple:
    the C side may parse them differently), anything else by ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return a is b or bool(a == b)
    except Exception:  # an object without a truth value for ==: not the same
        return False


def _unfit(run: Any) -> Optional[str]:
    """Why a known launcher still may not take the fast path, or None."""
    sizes = [getattr(run, k, None) for k in ("global_scratch_size", "profile_scratch_size")]
    if None in sizes:  # it could not be probed safely: its own call might allocate
        return "its launcher does not state the kernel's scratch memory"
    if any(sizes):
        return "the kernel needs scratch memory, which its own launcher allocates per call"
    if getattr(run, "gsan_enabled", False):
        return "the kernel runs instrumented (GSan), which its own launcher drives"
    return None


# ---------------------------------------------------------------- the launcher

class Launcher:
    """One kernel, one grid, fixed trailing arguments and constexprs.

    ``values`` holds every parameter after the per-call ones ``per_call`` (the
    plan's tensors stay alive with the plan that owns them).  The fast path
    passes them in the kernel's parameter order, constexprs included: Triton's
    C launcher takes and skips those.
    """

    __slots__ = ("fn", "grid", "tail", "runtime_tail", "constexprs", "options", "_fast", "_pre",
                 "_call", "_tried", "_proven")

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
        self._call: Callable[..., None] = _flat_call
        self._tried = False
        self._proven = False

    @property
    def ready(self) -> bool:
        """Whether :meth:`launch_addresses` may be used: the fast path is
        known and its first call went through."""
        return self._proven

    def launch_addresses(self, device: int, head: tuple) -> None:
        """Launch on the current stream, the per-call arguments given as they
        reach the kernel: addresses for tensors (0 for an unused pointer),
        numbers.  An address skips the C launcher's ``data_ptr()`` call and its
        CUDA pointer-attribute query: microseconds per call over nine pointers."""
        self._call(self._fast, self.grid, _stream(device), self._pre, head, self.tail)

    def __call__(self, device: int, head: tuple, aligned: bool) -> None:
        """Launch with the per-call arguments ``head`` (tensors) on the current stream."""
        if not self._tried and aligned:
            self._tried = True
            try:
                self._prepare(head)
            except Exception as e:  # launch mechanics only: kernel[grid] below raises real errors
                self._fast = None
                self._fell_back("prepare", f"preparing it raised {e!r}")
        if self._fast is not None and aligned:
            if self._proven:
                self._call(self._fast, self.grid, _stream(device), self._pre, head, self.tail)
                return
            try:
                self._call(self._fast, self.grid, _stream(device), self._pre, head, self.tail)
            except Exception as e:  # nothing was launched: kernel[grid] below launches, or raises
                self._fast = None
                self._fell_back("first-call", f"its first call raised {e!r}")
            else:
                self._proven = True
                return
        self.fn[(self.grid,)](*head, *self.runtime_tail, **self.constexprs, **self.options)

    def _fell_back(self, key: str, why: str) -> None:
        name = getattr(self.fn, "__name__", None) or getattr(getattr(self.fn, "fn", None),
                                                              "__name__", "a kernel")
        once(f"triton-launcher:{key}",
             f"fusion_pass: Triton {_triton_version()}'s launcher of {name} is not used directly "
             f"({why}); the kernels launch through kernel[grid] (correct, slower on the host)",
             logging.WARNING)

    def _prepare(self, head: tuple) -> None:
        """Compile (or find) the kernel for these arguments and keep its C
        launch function, with the header and packing of its generation."""
        from triton import knobs

        hook = knobs.runtime.launch_enter_hook  # a HookChain since Triton 3.6, None before
        if knobs.runtime.interpret or (hook is not None and getattr(hook, "calls", True)):
            return
        warmup = getattr(self.fn, "warmup", None)
        if warmup is None:
            return
        kernel = warmup(*head, *self.runtime_tail, grid=(self.grid,), **self.constexprs,
                        **self.options)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        run = kernel.run  # loads the kernel: its handle is read below
        why = _unfit(run)
        if why is not None:
            self._fell_back("unfit", why)
            return
        gen = generation(run)
        if gen is None:
            self._fell_back("generation", f"its launcher {type(run).__qualname__} calls its C "
                            "function in a layout the fast path does not know")
            return
        self._pre = gen.header(run, kernel.function, kernel.packed_metadata)
        self._call = gen.call
        self._fast = run.launch

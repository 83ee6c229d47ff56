"""Stand-ins for Triton's CUDA launcher, one per launcher generation, written by
hand from ``triton/backends/nvidia/driver.py`` and ``driver.c`` of the PyPI
wheels triton 3.6.0 and 3.8.0, and the installed Triton's own launcher with
only its compiled C parts stubbed.

- ``Run36`` / ``Run38``: ``CompiledKernel.run`` (a ``CudaLauncher``) of each
  release: its attributes and its ``__call__``, which is how ``JITFunction.run``
  launches (``run(gridX, gridY, gridZ, stream, function, kernel_metadata,
  launch_metadata, enter_hook, exit_hook, *kernel_args)``).
- ``CLaunch36`` / ``CLaunch38``: the C ``launch`` function each release's
  launcher calls, with that function's argument parsing: 3.6's generated
  ``PyArg_ParseTuple`` format ``"iiiKKppOOOOOO"`` plus one unit per kernel
  argument (13 + n arguments), 3.8's ``"iiiKKpp(iii)OOOOOOy*O"`` (16 arguments,
  the kernel's own as one sequence walked by the annotations).  Wrong arity or
  types raise ``TypeError`` as ``PyArg_ParseTuple`` does; pointers are
  extracted as the C code does (an int is the address, else ``data_ptr()``).
  Each records what it would launch.
- ``installed_cuda_launcher``: the installed Triton's ``CudaLauncher`` built on
  the CPU for a kernel: ``compile_module_from_src`` / ``compile_module_from_file``
  return a stub module and ``triton.runtime.driver.active`` a stub driver for
  the time it is built; its Python (``__init__``, ``__call__``) is Triton's.

These are the oracle the fast launch is tested against: nothing here reads
``fusion_pass.backends.triton_symm.launch``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator, Optional

# --------------------------------------------------------------- signatures

ARG_CONSTEXPR, ARG_KERNEL = 0, 1
"""3.8's ``ArgType`` values (driver.c)."""


def signature(kernel: Any) -> dict[str, str]:
    """A Triton signature of ``kernel``'s parameters for these stand-ins:
    ``constexpr``, a pointer (``*i8``: the names ending in ``_ptr``/``_ptrs``),
    ``fp32`` for ``eps`` and ``mult`` (float scalars) and ``i64`` for the other integers.
    The C side extracts by that class alone (address, integer, float)."""
    out = {}
    for p in kernel.params:
        if p.is_constexpr:
            out[p.name] = "constexpr"
        elif p.name.endswith(("_ptr", "_ptrs")):
            out[p.name] = "*i8"
        elif p.name in ("eps", "mult"):  # a float epsilon, a float multiplier
            out[p.name] = "fp32"
        else:
            out[p.name] = "i64"
    return out


def _pointer(obj: Any) -> int:
    """driver.c's pointer extraction (3.6 ``getPointer``, 3.8 ``extractPointer``)."""
    if obj is None:
        return 0
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj
    data_ptr = getattr(obj, "data_ptr", None)
    if data_ptr is None:
        raise TypeError("Pointer argument must be either uint64 or have data_ptr method")
    ret = data_ptr()
    if not isinstance(ret, int):
        raise TypeError("data_ptr method of Pointer object must return 64-bit int")
    return ret


def _int(obj: Any, what: str) -> int:
    if not isinstance(obj, int):
        raise TypeError(f"{what}: an integer is required (got type {type(obj).__name__})")
    return int(obj)


def _extract(ty: str, obj: Any) -> Any:
    if ty.startswith("*"):
        return _pointer(obj)
    if ty.startswith("fp"):
        if not isinstance(obj, (int, float)):
            raise TypeError(f"must be real number, not {type(obj).__name__}")
        return float(obj)
    return _int(obj, ty)


@dataclass
class Launch:
    """What one C call would launch: the header as parsed, the kernel's
    arguments as passed (``raw``) and as extracted (constexprs dropped)."""

    grid: tuple[int, int, int]
    stream: int
    function: int
    cooperative: bool
    pdl: bool
    metadata: tuple[int, int, int]
    scratch: tuple[Any, Any]
    hooks: tuple[Any, Any]
    raw: tuple
    extracted: list
    positional: tuple = field(repr=False, default=())


def _header(grid_x: Any, grid_y: Any, grid_z: Any, stream: Any, function: Any) -> tuple:
    return ((_int(grid_x, "gridX"), _int(grid_y, "gridY"), _int(grid_z, "gridZ")),
            _int(stream, "stream"), _int(function, "function"))


def _metadata(kernel_metadata: Any) -> tuple[int, int, int]:
    if not isinstance(kernel_metadata, tuple) or len(kernel_metadata) != 3:
        raise TypeError("kernel_metadata must be a tuple")
    return tuple(_int(v, "kernel_metadata") for v in kernel_metadata)  # type: ignore[return-value]


# ----------------------------------------------------------- Triton 3.6

class CLaunch36:
    """3.6's per-kernel C ``launch`` (``make_launcher``): 13 header arguments,
    then one per kernel argument, constexprs included (format ``O``, ignored)."""

    HEADER = 13

    def __init__(self, sig: dict[str, str]) -> None:
        self.types = list(sig.values())
        self.launches: list[Launch] = []

    def __call__(self, *args: Any) -> None:
        n = self.HEADER + len(self.types)
        if len(args) != n:
            raise TypeError(f"function takes exactly {n} arguments ({len(args)} given)")
        (gx, gy, gz, stream, function, coop, pdl, global_scratch, profile_scratch, kernel_metadata,
         launch_metadata, enter_hook, exit_hook) = args[:self.HEADER]
        grid, stream, function = _header(gx, gy, gz, stream, function)
        kernel_args = args[self.HEADER:]
        extracted = [_extract(ty, a) for ty, a in zip(self.types, kernel_args) if ty != "constexpr"]
        self.launches.append(Launch(grid, stream, function, bool(coop), bool(pdl),
                                    _metadata(kernel_metadata), (global_scratch, profile_scratch),
                                    (enter_hook, exit_hook), tuple(kernel_args), extracted, args))


class Run36:
    """3.6's ``CudaLauncher``: ``__call__(gridX, gridY, gridZ, stream, function,
    *args)`` calls ``launch(gridX, gridY, gridZ, stream, function,
    launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch, *args)``."""

    def __init__(self, sig: dict[str, str], pdl: bool = True, cooperative: bool = False) -> None:
        self.launch = CLaunch36(sig)
        self.num_ctas = 1
        self.global_scratch_size = self.profile_scratch_size = 0
        self.global_scratch_align = self.profile_scratch_align = 1
        self.launch_cooperative_grid = cooperative
        self.launch_pdl = pdl

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        # Scratch sizes are 0 here: no allocation, None for both buffers.
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, None, None, *args)


# ----------------------------------------------------------- Triton 3.8

@dataclass(frozen=True)
class KernelArg:
    """3.8's ``PyKernelArg`` (driver.c): an annotation of one argument."""

    type: int
    nested_tuple: Optional[list] = None


class CLaunch38:
    """3.8's generic C ``launch`` (driver.c ``launchKernel``): 16 arguments,
    ``"iiiKKpp(iii)OOOOOOy*O"``; the kernel arguments are walked by the
    annotations (a constexpr skipped), one per byte of the signature."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __call__(self, gridX, gridY, gridZ, stream, function, launch_cooperative_grid, launch_pdl,
                 kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook,
                 global_scratch, profile_scratch, arg_annotations, kernel_signature, kernel_args):
        grid, stream, function = _header(gridX, gridY, gridZ, stream, function)
        metadata = _metadata(kernel_metadata)
        if not isinstance(kernel_signature, (bytes, bytearray, memoryview)):
            raise TypeError("a bytes-like object is required, not "
                            f"'{type(kernel_signature).__name__}'")
        try:
            args = list(kernel_args)
        except TypeError:
            raise TypeError("Expected kernel_args to be a sequence or iterable") from None
        # driver.c reads one argument per annotation without a bound check.
        assert len(args) == len(arg_annotations), "kernel_args and annotations differ in length"
        kept = [a for ann, a in zip(arg_annotations, args) if ann.type == ARG_KERNEL]
        types = bytes(kernel_signature).decode().split(",") if kernel_signature else []
        assert len(kept) == len(types), "kernel arguments and signature bytes differ in length"
        extracted = [_extract(ty, a) for ty, a in zip(types, kept)]
        _pointer(global_scratch)
        _pointer(profile_scratch)
        self.launches.append(Launch(grid, stream, function, bool(launch_cooperative_grid),
                                    bool(launch_pdl), metadata, (global_scratch, profile_scratch),
                                    (launch_enter_hook, launch_exit_hook), tuple(kernel_args),
                                    extracted,
                                    (gridX, gridY, gridZ, stream, function, launch_cooperative_grid,
                                     launch_pdl, kernel_metadata, launch_metadata,
                                     launch_enter_hook, launch_exit_hook, global_scratch,
                                     profile_scratch, arg_annotations, kernel_signature,
                                     kernel_args)))


class Run38:
    """3.8's ``CudaLauncher``: ``__call__(gridX, gridY, gridZ, stream, function,
    kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook,
    *args)`` calls ``launch(gridX, gridY, gridZ, stream, function,
    launch_cooperative_grid, launch_pdl, kernel_metadata, launch_metadata,
    launch_enter_hook, launch_exit_hook, global_scratch, profile_scratch,
    arg_annotations, kernel_signature, kernel_args)``.  The signature bytes
    stand in for ``build_signature_metadata``'s (one byte per extractor): here
    the types, comma-separated."""

    def __init__(self, sig: dict[str, str], pdl: bool = True, cooperative: bool = False,
                 launch: Any = None) -> None:
        self.gsan_enabled = False
        self.arg_annotations = [KernelArg(ARG_CONSTEXPR if ty == "constexpr" else ARG_KERNEL)
                                for ty in sig.values()]
        self.kernel_signature = ",".join(ty for ty in sig.values() if ty != "constexpr").encode()
        self.num_ctas = 1
        self.launch = CLaunch38() if launch is None else launch
        self.global_scratch_size = self.profile_scratch_size = 0
        self.global_scratch_align = self.profile_scratch_align = 1
        self.launch_cooperative_grid = cooperative
        self.launch_pdl = pdl

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, None, None, self.arg_annotations, self.kernel_signature, args)


# -------------------------------------------------- the installed launcher

class _StubFunction:
    """A compiled C function's stand-in: answers any call with a namespace."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(stub=self.name, args=args, kwargs=kwargs)

    def __repr__(self) -> str:
        return f"<stub {self.name}>"


class _StubModule:
    """A compiled C module's stand-in: every attribute a stub function, the
    same one each time it is asked for."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getattr__(self, attr: str) -> _StubFunction:
        if attr.startswith("__"):
            raise AttributeError(attr)
        fn = _StubFunction(f"{self.__name__}.{attr}")
        setattr(self, attr, fn)
        return fn


@contextlib.contextmanager
def installed_cuda_launcher_class() -> Iterator[Any]:
    """The installed Triton's ``CudaLauncher`` class, constructible on the CPU
    while the context lasts: the driver module's C-module compilers return a
    stub module, its ``library_dirs`` is empty (no libcuda), and the active
    driver is a stub whose ``utils`` is ``CudaUtils()`` built on that stub.
    Everything changed is put back (module globals, ``CudaUtils``' singleton,
    the active driver)."""
    import triton.backends.nvidia.driver as drv
    from triton.runtime.driver import driver

    saved = dict(vars(drv))
    had_instance = "instance" in vars(drv.CudaUtils)
    saved_instance = vars(drv.CudaUtils).get("instance")
    saved_active = getattr(driver, "_active", None)
    modules: dict[str, _StubModule] = {}

    def compile_stub(*args: Any, **kwargs: Any) -> _StubModule:
        name = kwargs.get("name", "module")
        return modules.setdefault(name, _StubModule(name))

    try:
        for name in ("compile_module_from_src", "compile_module_from_file"):
            if name in saved:
                setattr(drv, name, compile_stub)
        drv.library_dirs = lambda: []
        if had_instance:
            del drv.CudaUtils.instance
        utils = drv.CudaUtils()
        driver.set_active(SimpleNamespace(utils=utils, launcher_cls=drv.CudaLauncher))
        yield drv.CudaLauncher
    finally:
        driver._active = saved_active
        if "instance" in vars(drv.CudaUtils):
            del drv.CudaUtils.instance
        if had_instance:
            drv.CudaUtils.instance = saved_instance
        for k in list(vars(drv)):
            if k not in saved:
                delattr(drv, k)
        for k, v in saved.items():
            if k not in vars(drv) or vars(drv)[k] is not v:
                setattr(drv, k, v)


def compiled_metadata(pdl: bool = True, cooperative: bool = False) -> SimpleNamespace:
    """A ``CompiledKernel.metadata`` stand-in: the installed CUDA backend's
    option defaults (``CUDAOptions``) with PDL and the cooperative flag as
    given, and the fields compilation adds, no scratch memory."""
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions

    fields = {f.name: getattr(CUDAOptions(), f.name) for f in dataclasses.fields(CUDAOptions)}
    fields.update(launch_pdl=pdl, launch_cooperative_grid=cooperative, shared=0,
                  global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                  profile_scratch_align=1, tensordesc_meta=None)
    return SimpleNamespace(**fields)


def ast_source(kernel: Any) -> Any:
    """The ``ASTSource`` ``JITFunction.run`` would make for ``kernel`` with
    :func:`signature`'s types and a value for each constexpr."""
    from triton.compiler import ASTSource

    sig = signature(kernel)
    return ASTSource(kernel, sig, {k: 1 for k, ty in sig.items() if ty == "constexpr"})

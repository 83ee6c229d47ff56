"""The fast launch (``backends/triton_symm/launch.py``) without a GPU.

- The installed Triton's launcher is of a generation the fast path knows: its
  own ``CudaLauncher``, built on the CPU with only the compiled C parts stubbed,
  is recognised by the same function the runtime asks, and a ``Launcher`` over
  it takes the fast path.  This fails, naming the Triton version, on a Triton
  whose launcher changed again.
- Each generation's packing against stand-ins of Triton 3.6's and 3.8's C
  launch functions (``tests/helpers/triton_launcher_standins.py``): arity, the place of
  every argument, PDL and the cooperative flag as the compiled kernel asks,
  pointers as integers, 3.8's kernel arguments as one tuple.
- The fallback to ``kernel[grid]``: a launcher of an unknown shape, any
  exception from the first fast call (a ``TypeError`` and others a later
  Triton may raise), errors while preparing; one log line naming the Triton
  version, no exception from the launch mechanics; a real launch error still
  raised, by ``kernel[grid]``.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import triton

import triton_launcher_standins as si
from fusion_pass import log as fusion_log_module
from fusion_pass.backends.triton_symm import launch
from fusion_pass.backends.triton_symm.one_stage import one_stage_kernel
from fusion_pass.backends.triton_symm.two_stage import two_stage_kernel

from fusion_pass.backends.triton_symm.plan import PER_CALL  # the kernels' per-call parameters
STREAM, FUNCTION, METADATA, GRID = 0x5EED, 0xF00D, (8, 1, 4096), 6
KERNELS = [one_stage_kernel, two_stage_kernel]
KNOWN = {"3.6": "flat", "3.8": "generic", "3.9": "generic"}
"""The generation of the Triton lines whose sources the stand-ins were written from."""


class JIT:
    """A ``JITFunction`` stand-in over a real kernel's parameters: ``warmup``
    returns a compiled kernel whose ``run`` is the given launcher, and
    ``kernel[grid](...)`` (the ordinary path) is recorded."""

    def __init__(self, real: Any, run: Any, warmup_error: Exception | None = None) -> None:
        self.arg_names, self.params, self.__name__ = real.arg_names, real.params, real.__name__
        self.compiled = SimpleNamespace(run=run, function=FUNCTION, packed_metadata=METADATA)
        self.warmup_error = warmup_error
        self.warmups: list = []
        self.slow: list = []

    def warmup(self, *args: Any, grid: tuple, **kwargs: Any) -> Any:
        self.warmups.append((args, grid, kwargs))
        if self.warmup_error is not None:
            raise self.warmup_error
        return self.compiled

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **kwargs: self.slow.append((grid, args, kwargs))


@pytest.fixture(autouse=True)
def _cpu_triton(monkeypatch):
    """A stream without CUDA, Triton's own launch path (not the interpreter, no
    hooks), and the "said once" memory cleared."""
    from triton import knobs

    monkeypatch.setattr(launch, "_stream", lambda device: STREAM + device)
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    monkeypatch.setattr(fusion_log_module, "_said", set())


def plan_values(kernel: Any) -> dict[str, Any]:
    """Every parameter after the per-call ones, as a plan fixes them: the
    buffer's tensors, distinct integers, distinct constexpr values."""
    values: dict[str, Any] = {}
    for i, p in enumerate(kernel.params[len(PER_CALL):]):
        if p.name in ("local_ptr", "peer_ptrs", "state_ptr"):
            values[p.name] = torch.zeros(4 + i, dtype=torch.int64)
        else:
            values[p.name] = (1000 if p.is_constexpr else 100) + i
    return values


def head_tensors() -> tuple:
    """The per-call arguments: a distinct tensor per pointer, numbers for the scalars."""
    scalars = {"eps": 1e-6, "mult": 1.0}
    return tuple(scalars[name] if name in scalars else torch.zeros(8 + i)
                 for i, name in enumerate(PER_CALL))


def expected_args(kernel: Any, head: tuple, values: dict[str, Any]) -> tuple[list, list]:
    """The kernel's arguments as they should reach the C function (tensors as
    given), and as it extracts them (pointers as addresses, constexprs dropped)."""
    raw = list(head) + [v.data_ptr() if isinstance(v, torch.Tensor) else v
                        for v in (values[k] for k in kernel.arg_names[len(PER_CALL):])]
    sig = si.signature(kernel)
    extracted = [a.data_ptr() if isinstance(a, torch.Tensor) else a
                 for a, ty in zip(raw, sig.values()) if ty != "constexpr"]
    return raw, extracted


def log_lines(records: list) -> list[str]:
    return [r.getMessage() for r in records if r.name == "fusion_pass"]


# ------------------------------------------------------- the installed Triton

class _Appended:
    """A made-up launcher generation: the installed ``CudaLauncher`` with one
    more argument after its C call's last (a new flag, say)."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls

    def build(self, src: Any, metadata: Any) -> Any:
        base = self.cls

        class MadeUp(base):
            def __call__(self, *args: Any) -> None:
                real = self.launch
                self.launch = lambda *a: real(*a, 0)
                try:
                    base.__call__(self, *args)
                finally:
                    self.launch = real

        return MadeUp(src, metadata)


def installed_generation(kernel: Any, made_up: bool = False) -> str:
    """The name of the installed Triton's launcher generation for ``kernel``, as
    the runtime sees it; fails naming the Triton version when it is not known."""
    with si.installed_cuda_launcher_class() as cls:
        build = _Appended(cls).build if made_up else cls
        run = build(si.ast_source(kernel), si.compiled_metadata())
        gen = launch.generation(run)
    assert gen is not None, (
        f"Triton {triton.__version__}: its compiled kernel's launcher "
        f"({type(run).__module__}.{type(run).__qualname__}) calls its C launch function in a "
        f"layout none of {[g.name for g in launch.GENERATIONS]} makes; the fused kernels would "
        "launch through kernel[grid] (correct, slower on the host). Add its generation to "
        "fusion_pass/backends/triton_symm/launch.py.")
    return gen.name


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_installed_triton_launcher_is_a_known_generation(kernel):
    name = installed_generation(kernel)
    expected = KNOWN.get(".".join(triton.__version__.split(".")[:2]))
    if expected is not None:
        assert name == expected, f"Triton {triton.__version__}: {name}, expected {expected}"


def test_the_generation_check_fails_for_a_made_up_launcher():
    with pytest.raises(AssertionError, match=re.escape(f"Triton {triton.__version__}:")):
        installed_generation(one_stage_kernel, made_up=True)


@pytest.mark.parametrize("made_up", [False, True], ids=["installed", "made-up"])
def test_runtime_choice_over_the_installed_launcher(made_up, fusion_log):
    """What the check above says is what a ``Launcher`` does: the installed
    launcher (C parts stubbed) takes the fast path, the made-up one falls back."""
    with si.installed_cuda_launcher_class() as cls:
        build = _Appended(cls).build if made_up else cls
        run = build(si.ast_source(one_stage_kernel), si.compiled_metadata())
        fn = JIT(one_stage_kernel, run)
        lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {})
        lau(0, head_tensors(), aligned=True)
    assert lau.ready is (not made_up)
    assert len(fn.slow) == int(made_up)
    lines = log_lines(fusion_log)
    assert len(lines) == int(made_up)
    assert all(f"Triton {triton.__version__}" in line for line in lines)


# ------------------------------------------------------------- the packing

GENERATIONS = {"3.6": (si.Run36, "flat", si.CLaunch36.HEADER, False),
               "3.8": (si.Run38, "generic", 16, True)}


@pytest.mark.parametrize("triton_line", sorted(GENERATIONS))
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("pdl,cooperative", [(True, False), (False, True)])
def test_fast_launch_packs_as_each_c_launcher_parses(triton_line, kernel, pdl, cooperative):
    make, name, header, as_tuple = GENERATIONS[triton_line]
    run = make(si.signature(kernel), pdl=pdl, cooperative=cooperative)
    assert launch.generation(run).name == name
    fn = JIT(kernel, run)
    values = plan_values(kernel)
    lau = launch.Launcher(fn, GRID, PER_CALL, values, {"num_warps": 8})
    head = head_tensors()
    lau(1, head, aligned=True)

    assert fn.slow == [] and len(fn.warmups) == 1 and lau.ready
    assert fn.warmups[0][1] == (GRID,) and fn.warmups[0][2]["num_warps"] == 8
    (first,) = run.launch.launches
    n_args = len(kernel.arg_names)
    assert len(first.positional) == (header if as_tuple else header + n_args)
    assert first.grid == (GRID, 1, 1) and first.stream == STREAM + 1
    assert first.function == FUNCTION and first.metadata == METADATA
    assert first.pdl is pdl and first.cooperative is cooperative
    assert first.scratch == (None, None) and first.hooks == (None, None)
    raw, extracted = expected_args(kernel, head, values)
    assert len(first.raw) == n_args
    assert all(a is b or a == b for a, b in zip(first.raw, raw))
    assert first.extracted == extracted
    if as_tuple:
        assert type(first.positional[-1]) is tuple
        assert first.positional[13] is run.arg_annotations
        assert first.positional[14] is run.kernel_signature

    # A plan's later calls: addresses, not tensors, in the same places.
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in head)
    lau.launch_addresses(0, addresses)
    second = run.launch.launches[1]
    assert second.stream == STREAM and len(first.positional) == len(second.positional)
    assert all(type(a) is int for a, ty in zip(second.raw, si.signature(kernel).values())
               if ty.startswith("*"))
    assert second.extracted == extracted
    assert fn.slow == []


# ------------------------------------------------------------ the fallback

class RunOther(si.Run38):
    """A launcher of a shape no release has: the 3.8 header with PDL and the
    cooperative flag swapped and no scratch buffers, 14 arguments."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_pdl,
                    self.launch_cooperative_grid, kernel_metadata, launch_metadata,
                    launch_enter_hook, launch_exit_hook, self.arg_annotations,
                    self.kernel_signature, args)


class Counting:
    """A C launch function stand-in that counts its calls and then does what
    ``then`` does (parse, raise)."""

    def __init__(self, then: Any) -> None:
        self.then, self.calls = then, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.then(*args)


def _assert_fell_back(fn: JIT, lau: launch.Launcher, records: list, calls: int) -> None:
    head = head_tensors()
    for _ in range(calls - 1):
        lau(0, head, aligned=True)
    assert not lau.ready
    assert len(fn.slow) == calls
    grid, args, kwargs = fn.slow[-1]
    assert grid == (GRID,)
    assert args[len(PER_CALL):] == lau.runtime_tail
    assert all(a is b for a, b in zip(args[:len(PER_CALL)], head))
    assert {k: kwargs[k] for k in lau.constexprs} == lau.constexprs
    assert kwargs["num_warps"] == 8
    assert set(lau.constexprs) == {p.name for p in fn.params if p.is_constexpr}
    (line,) = log_lines(records)
    assert f"Triton {triton.__version__}" in line and "kernel[grid]" in line


def test_a_launcher_of_unknown_shape_falls_back_with_one_line(fusion_log):
    run = RunOther(si.signature(one_stage_kernel), launch=Counting(lambda *a: None))
    assert launch.generation(run) is None
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)  # raises nothing
    _assert_fell_back(fn, lau, fusion_log, calls=3)
    assert run.launch.calls == 0 and len(fn.warmups) == 1


def test_a_typeerror_from_the_first_fast_call_falls_back(fusion_log):
    """A launcher that looks like 3.8's but whose C function parses 3.6's layout
    (the reverse of the error Triton 3.8 gave the 3.6-only fast path)."""
    sig = si.signature(one_stage_kernel)
    c_function = Counting(si.CLaunch36(sig))
    run = si.Run38(sig, launch=c_function)
    assert launch.generation(run).name == "generic"
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)  # raises nothing
    assert c_function.calls == 1 and c_function.then.launches == []
    _assert_fell_back(fn, lau, fusion_log, calls=3)
    assert c_function.calls == 1  # never tried again
    assert "takes exactly" in log_lines(fusion_log)[0]


@pytest.mark.parametrize("error", [
    ValueError("signature byte 9 has no extractor"), OverflowError("int too big to convert"),
    SystemError("error return without exception set"), KeyError("arg_annotations"),
    RuntimeError("Triton Error [CUDA]: invalid argument"), IndexError("tuple index out of range")])
def test_any_exception_from_the_first_fast_call_falls_back(error, fusion_log):
    """Whatever a C launch function of a later Triton raises on its first call
    (its argument parsing, the driver refusing the launch), nothing was launched:
    the launcher turns to kernel[grid] for good, with one log line naming the
    exception, and the call itself launches through kernel[grid]."""
    c_function = Counting(lambda *args: (_ for _ in ()).throw(error))
    run = si.Run38(si.signature(one_stage_kernel), launch=c_function)
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)  # raises nothing
    assert c_function.calls == 1 and len(fn.slow) == 1
    _assert_fell_back(fn, lau, fusion_log, calls=3)
    assert c_function.calls == 1  # never tried again
    line = log_lines(fusion_log)[0]
    assert type(error).__name__ in line and "first call" in line


def test_a_real_launch_error_is_raised_by_kernel_grid():
    """A failure the ordinary path has too (a lost CUDA context) is not hidden:
    the fast call's exception turns the launcher to kernel[grid], which raises it."""
    def launch_failed(*args):
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    class Failing(JIT):
        def __getitem__(self, grid):
            def slow(*args, **kwargs):
                self.slow.append((grid, args, kwargs))
                launch_failed()
            return slow

    run = si.Run38(si.signature(one_stage_kernel), launch=launch_failed)
    fn = Failing(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        lau(0, head_tensors(), aligned=True)
    assert len(fn.slow) == 1 and not lau.ready


def test_a_proven_launcher_pays_no_guard():
    """After its first fast call went through, a launcher's calls are not caught:
    an exception of a later call reaches the caller as it is."""
    calls = []

    def launch_then_fail(*args):
        calls.append(args)
        if len(calls) > 1:
            raise RuntimeError("Triton Error [CUDA]: launch failed")

    run = si.Run38(si.signature(one_stage_kernel), launch=launch_then_fail)
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)
    assert lau.ready
    with pytest.raises(RuntimeError, match="launch failed"):
        lau(0, head_tensors(), aligned=True)
    assert fn.slow == [] and lau.ready


@pytest.mark.parametrize("error", [AttributeError("'CompiledKernel' has no attribute 'run'"),
                                   ImportError("cannot import name 'knobs'"),
                                   RuntimeError("0 active drivers")])
def test_an_error_while_preparing_falls_back(error, fusion_log):
    fn = JIT(one_stage_kernel, si.Run38(si.signature(one_stage_kernel)), warmup_error=error)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)
    _assert_fell_back(fn, lau, fusion_log, calls=2)
    assert len(fn.warmups) == 1
    assert type(error).__name__ in log_lines(fusion_log)[0]


class _NoProbe(si.Run38):
    """A launcher whose own call must not run (it would allocate scratch or
    drive instrumentation): the probe counts as a call."""

    def __call__(self, *args):
        self.called = True


@pytest.mark.parametrize("field,value", [("global_scratch_size", 64),
                                         ("profile_scratch_size", 64), ("gsan_enabled", True),
                                         ("profile_scratch_size", None)])
def test_scratch_or_instrumented_kernels_keep_kernel_grid(field, value, fusion_log):
    run = _NoProbe(si.signature(one_stage_kernel))
    if value is None:  # a launcher that does not say
        delattr(run, field)
    else:
        setattr(run, field, value)
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {"num_warps": 8})
    lau(0, head_tensors(), aligned=True)
    _assert_fell_back(fn, lau, fusion_log, calls=2)
    assert not hasattr(run, "called") and run.launch.launches == []


def test_misaligned_calls_and_the_interpreter_never_prepare(monkeypatch):
    from triton import knobs

    run = si.Run38(si.signature(one_stage_kernel))
    fn = JIT(one_stage_kernel, run)
    lau = launch.Launcher(fn, GRID, PER_CALL, plan_values(one_stage_kernel), {})
    lau(0, head_tensors(), aligned=False)
    assert fn.warmups == [] and len(fn.slow) == 1
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    lau(0, head_tensors(), aligned=True)
    assert fn.warmups == [] and len(fn.slow) == 2 and not lau.ready
    assert run.launch.launches == []

"""The kernels' arrival at the slot counter, in the PTX Triton makes for Hopper (no GPU
needed: Triton compiles for a target it is told).

The slot protocol's ordering rests on what the compiled code does, not on the Python:
every thread has used the state word before a barrier, then one thread arrives with a
relaxed atomic whose operand is computed from the word (``lamport.advance_slot``).
An acquire-release arrival would also be correct but waits for the pushes' NVLink
acknowledgements; an immediate operand or a missing barrier would leave the race the
protocol closes.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from fusion_pass.backends.triton_symm.call_args import MUL_ARG  # noqa: E402  (a multiplier argument)

POINTERS = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
            "h_ptr": "*bf16", "q_ptr": "*bf16", "s_ptr": "*fp32", "scale_ptr": "*bf16",
            "local_ptr": "*i16", "peer_ptrs": "*i64", "state_ptr": "*i32"}
SCALARS = {"eps": "fp32", "mult": "fp32", "rank": "i32", "n": "i32", "chunk": "i32", "timeout_ns": "i64",
           "slot_elems": "i64", "s_row": "i32", "s_group": "i32"}
CONSTEXPRS = dict(HIDDEN=8192, BLOCK=8192, WORLD=2, HAS_RES=True, GEMMA=False, NEG0=-32768,
                  SLOTS=3, EPS_PTR=False, EMIT_Y=True, QUANT=0, GROUP=128, QMAX=448.0,
                  INV_QMAX=1 / 448, FLOOR=1e-10, RECIP=False, FNUZ=False, PDL=True,
                  ROUND_N=False, MUL=MUL_ARG)


def _ptx(kernel, pointers: dict | None = None, num_warps: int = 8, **constexprs) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    values = {**CONSTEXPRS, **constexprs}
    pointers = {**POINTERS, **(pointers or {})}
    signature = {a: pointers.get(a) or SCALARS.get(a) or "constexpr" for a in names}
    aligned = [a for a in names if a in pointers] + ["slot_elems"]
    src = ASTSource(kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in values.items() if k in names},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps))
    except Exception as e:  # no CUDA toolchain in this Triton build
        from triton.compiler.errors import CompilationError

        if isinstance(e, CompilationError):  # the kernel itself does not compile: a failure
            raise
        pytest.skip(f"Triton cannot compile for sm_90 here: {e!r}")
    return compiled.asm["ptx"]


def _arrival(ptx: str) -> tuple[str, str]:
    """The PTX before the arrival atomic, and the atomic's line."""
    lines = ptx.splitlines()
    at = [i for i, line in enumerate(lines) if re.search(r"\batom\.global\b.*\.add\.", line)]
    assert len(at) == 1, [lines[i] for i in at]
    return "\n".join(lines[:at[0]]), lines[at[0]]


@pytest.mark.parametrize("which", ["one_stage", "one_stage_own", "two_stage"])
def test_arrival_is_relaxed_after_a_barrier_with_an_operand_from_the_state(which):
    if which == "two_stage":
        from fusion_pass.backends.triton_symm.two_stage import two_stage_kernel as kernel
        ptx = _ptx(kernel)
    else:
        from fusion_pass.backends.triton_symm.one_stage import one_stage_kernel as kernel
        own = which == "one_stage_own"
        ptx = _ptx(kernel, SPLIT=8 if own else 1, PART=1024 if own else 8192,
                   BLOCK=1024 if own else 8192, OWN=own)
    before, atom = _arrival(ptx)
    assert ".relaxed." in atom and ".acq_rel" not in atom and ".release" not in atom, atom
    operand = atom.rstrip(";").split(",")[-1].strip()
    assert operand.startswith("%r"), f"the operand is not computed from the state: {atom}"
    # The state word: the first 32-bit volatile load, made by every thread (no predicate).
    word = re.search(r"^\s*ld\.volatile\.global\.b32 \{ (%r\d+) \}", before, re.M)
    assert word, "the state word is not loaded by every thread before the arrival"
    assert _derives_from(before, operand, word.group(1)), (operand, word.group(1))
    # A barrier between the word's load and the arrival, and none of the word's uses
    # that every thread makes (pushes, the clearing loop's bound) after it.
    assert "bar.sync" in before[word.end():], "no barrier before the arrival"


def _derives_from(ptx: str, reg: str, source: str, depth: int = 6) -> bool:
    """Whether ``reg`` is computed from ``source`` in at most ``depth`` instructions."""
    if reg == source:
        return True
    if depth == 0:
        return False
    defs = re.findall(r"^\s*[a-z][\w.]*\s+" + re.escape(reg) + r",\s*(.+);$", ptx, re.M)
    return any(_derives_from(ptx, src, source, depth - 1)
               for line in defs for src in re.findall(r"%r\d+", line))


FP32 = {"x_ptr": "*fp32", "res_ptr": "*fp32", "w_ptr": "*fp32", "y_ptr": "*fp32",
        "h_ptr": "*fp32", "local_ptr": "*i32"}


@pytest.mark.parametrize("which", ["one_stage", "two_stage"])
def test_every_square_of_the_norm_is_rounded_before_the_sum(which):
    """Every rank must get the same ``y`` for a row (the unfused graph normalises one
    all-reduced tensor).  The two-stage kernel finishes a row in two inlined copies of
    the norm (its owner's and its peers'); had the squares been plain products, the
    compiler would contract them into the reduction's adds as fma(a, a, b * b), pairing
    them differently in each copy (Triton 3.8, fp32 rows of 16384 at 32 warps: y
    differed between ranks).  Rounded squares leave nothing to contract."""
    if which == "two_stage":
        from fusion_pass.backends.triton_symm.two_stage import two_stage_kernel as kernel
    else:
        from fusion_pass.backends.triton_symm.one_stage import one_stage_kernel as kernel
    extra = {} if which == "two_stage" else dict(SPLIT=1, PART=16384, OWN=False)
    ptx = _ptx(kernel, pointers=FP32, num_warps=32, HIDDEN=16384, BLOCK=16384,
               NEG0=-2 ** 31, **extra)
    square = r"%r\d+, (%r\d+), \1"
    contracted = re.findall(r"fma\.rn\.f32\s+" + square + r", (?!0f00000000;)", ptx)
    unrounded = re.findall(r"mul\.f32\s+" + square + ";", ptx)
    rounded = re.findall(r"fma\.rn\.f32\s+" + square + ", 0f00000000;", ptx)
    assert not contracted and not unrounded, (len(contracted), len(unrounded))
    assert len(rounded) >= 16, "the squares (16 per thread) were not found"

"""The CUDA-only instructions the kernels use, kept here so that a port to
another Triton target (ROCm: ``s_memrealtime``, no programmatic dependent
launch) changes this file alone.

Everything else in the kernels is portable Triton: volatile loads for the
Lamport mailboxes, ``tl.atomic_add`` for the slot counter, ``tl.device_assert``
for the timeout error.
"""

import triton
import triton.language as tl


@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's global timer (the same clock on every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With programmatic dependent launch the kernel may be resident while the
    kernel before it in the stream still runs: its launch and scheduling
    overlap that kernel's tail.  Every load (the slot counter, x, the
    residual, even the weight) waits here until that kernel has finished and
    its writes are visible, so the protocol is exactly that of a plain launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """Let the next kernel in the stream be launched (it waits in
    :func:`wait_for_previous_kernel` for this one to end).  Called once the
    pushes are issued: from there on this kernel only waits and finishes rows."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

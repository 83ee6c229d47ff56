"""The one PTX-only instruction the kernels use, kept here so that a port to
another Triton target (ROCm: ``s_memrealtime``) changes this file alone.

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

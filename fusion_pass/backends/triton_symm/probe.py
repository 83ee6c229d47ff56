"""Reading every rank's buffer through the addresses the kernels will use.

A new symmetric buffer is proven before its first call (``buffers.arm``): each
rank tags the first and the last element of its own buffer, and every rank
reads both through its table of peer addresses.  A wrong address (a peer's
mapping of another allocation, or the wrong offset into it) reads something
else, and the buffer is refused before a kernel trusts it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def read_ends_kernel(peer_ptrs, out_ptr, last):
    p = tl.program_id(0)
    IT: tl.constexpr = out_ptr.dtype.element_ty
    base = tl.load(peer_ptrs + p).to(tl.pointer_type(IT))
    tl.store(out_ptr + 2 * p, tl.load(base, volatile=True))
    tl.store(out_ptr + 2 * p + 1, tl.load(base + last, volatile=True))


def read_ends(peer_ptrs: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``[world, 2]``: the first and the last of ``numel`` elements at each address."""
    out = torch.empty((peer_ptrs.numel(), 2), dtype=dtype, device=peer_ptrs.device)
    read_ends_kernel[(peer_ptrs.numel(),)](peer_ptrs, out, numel - 1)
    return out

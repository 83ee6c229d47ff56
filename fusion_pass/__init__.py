"""fusion_pass: fuse tensor-parallel all-reduce + RMSNorm in torch.compile graphs.

The core (gate, op, pass, patterns) imports with torch alone; vLLM, Triton and
AITER are imported only where they are used.
"""

from .allreduce_rmsnorm_pass import AllReduceRMSNormFusionPass
from .backends import set_backend
from .gate import BackendLimits, Decision, Path, TokenRange, decide
from .op import fused_allreduce_rmsnorm, fused_allreduce_rmsnorm_quant
from .quant import QuantSpec

__all__ = [
    "AllReduceRMSNormFusionPass",
    "BackendLimits",
    "Decision",
    "Path",
    "QuantSpec",
    "TokenRange",
    "decide",
    "fused_allreduce_rmsnorm",
    "fused_allreduce_rmsnorm_quant",
    "set_backend",
]
__version__ = "0.1.0"

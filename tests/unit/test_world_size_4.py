"""World size 4, simulated with four gloo ranks: the pass and the reference backend.

(The Triton kernels at world sizes 4 and 8 have not run on GPUs; see README, "Tested where".)
"""

from __future__ import annotations

import pytest
import torch

from fusion_pass.testing.spawn import run_ranks
from test_op import float64_reference, make_inputs
from test_pass import FUSED, _compile_case, _hf_norm, _ar


def _four_ranks(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import fusion_pass

    group = dist.group.WORLD
    out = {}
    for tokens, hidden in [(1, 2880), (81, 128)]:
        x, r, w = make_inputs(rank, tokens, hidden, torch.bfloat16)
        out[(tokens, hidden)] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group.group_name, residual=r)

    x, r, w = make_inputs(rank, 16, 64, torch.bfloat16)

    def layer(a, b):
        h = _ar(a, group) + b
        return _hf_norm(h, w, 1e-6), h

    out["compiled"] = _compile_case(layer, (x, r), fusion_pass.AllReduceRMSNormFusionPass(
        token_range=fusion_pass.TokenRange(1, 64)))
    out["decision"] = fusion_pass.decide(8192, "bfloat16", world_size, 8)
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4)


def test_reference_backend_sums_four_ranks(four) -> None:
    for tokens, hidden in [(1, 2880), (81, 128)]:
        y_ref, h_ref = float64_reference(4, tokens, hidden, torch.bfloat16, 1e-6, True, False)
        for res in four:
            y, h = res[(tokens, hidden)]
            torch.testing.assert_close(h.double(), h_ref, rtol=2e-2, atol=3e-2)
            torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=4e-2)
            assert torch.equal(y, four[0][(tokens, hidden)][0])


def test_pass_fuses_at_world_size_4(four) -> None:
    for res in four:
        case = res["compiled"]
        assert case["after"].count(FUSED) == 1
        assert case["sites"][0][1] == "one_stage"
        for a, b in zip(case["out"], case["eager"]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=4e-2)
        assert res["decision"].path.value == "one_stage"

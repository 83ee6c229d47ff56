"""The same graph compiles to the same code: a fused op's arguments carry no random id.

Each rank compiles one function twice, in fresh dynamo state and with Inductor's
caches off (so that the pass runs both times), and compares Inductor's output
code and the fused op's ``site`` argument; the op reports each site once.
"""

from __future__ import annotations

from fusion_pass.testing.spawn import run_ranks

HIDDEN = 64


def _compile_twice(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from fusion_pass import AllReduceRMSNormFusionPass, op, records

    group = dist.group.WORLD
    w = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN), requires_grad=False)

    def block(x, r):
        h = fc.all_reduce(x, "sum", group) + r
        v = h.float()
        y = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        h2 = fc.all_reduce(y, "sum", group) + h
        v2 = h2.float()
        return w * (v2 * torch.rsqrt(v2.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h2.dtype)

    config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(rank))
    r = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    codes = []
    for _ in range(2):
        torch._dynamo.reset()
        with torch.inference_mode():
            _, code = run_and_get_code(torch.compile(block, fullgraph=True), x, r)
        # Inductor numbers its compiles in a header comment: the rest is the code.
        codes.append("\n".join(line for c in code for line in c.splitlines()
                               if not line.startswith("# AOT ID:")))
    reported = []
    real = records.site_ran
    records.site_ran = lambda tag: reported.append(tag) or real(tag)
    try:
        compiled = torch.compile(block, fullgraph=True)
        with torch.inference_mode():
            for _ in range(3):
                compiled(x, r)
    finally:
        records.site_ran = real
    return {"codes": codes, "ids": [g.uuid for g in records.HISTORY],
            "reported": reported, "seen": len(op._sites_run)}


def test_the_same_graph_compiles_to_the_same_code() -> None:
    for rank in run_ranks(_compile_twice, 2):
        first, second = rank["codes"]
        assert first == second
        # Two fused sites, each carrying its record.
        assert first.count("torch.ops.fusion_pass.allreduce_rmsnorm.default(") == 2, first
        assert first.count('"path": "one_stage"') == 2, first
        assert len(set(rank["ids"])) == 1 and len(rank["ids"]) == 2
        # The op hands each site to the records once, however often it runs.
        assert rank["reported"] == [] and rank["seen"] == 2

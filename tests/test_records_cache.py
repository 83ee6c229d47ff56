"""A graph loaded from Inductor's compile cache still says what it fused.

The post-grad pass never runs on an FX-graph-cache hit; the fused ops carry their
site records and report them on their first call.  Two runs of fresh processes
share one cache directory: the first compiles (records from the pass), the second
hits the cache (records from the ops, ``source="cache"``).
"""

from __future__ import annotations

import torch

from fusion_pass.testing.spawn import run_ranks

HIDDEN = 64


def _compile_and_run(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch._dynamo.utils import counters
    from torch._inductor import config

    from fusion_pass import AllReduceRMSNormFusionPass, records

    group = dist.group.WORLD
    w = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN), requires_grad=False)

    def block(x, r):
        h = fc.all_reduce(x, "sum", group) + r
        v = h.float()
        y = w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
        s = fc.all_reduce(y, "sum", group) * 2  # no norm after it: recorded, not fused
        return y, h, s

    config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(rank))
    r = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got = torch.compile(block, fullgraph=True)(x, r)
    return {"hits": counters["inductor"]["fxgraph_cache_hit"],
            "records": [(g.source, g.total, [(s.path, s.reason) for s in g.sites])
                        for g in records.HISTORY],
            "out": got, "eager": block(x, r)}


def test_a_cache_hit_reports_the_fused_sites(tmp_path) -> None:
    from fusion_pass import records

    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           records.RECORD_DIR_ENV: str(tmp_path / "records")}
    first = run_ranks(_compile_and_run, 2, env=env)
    second = run_ranks(_compile_and_run, 2, env=env)
    for a, b in zip(first, second):
        assert a["hits"] == 0 and b["hits"] >= 1
        (source, total, sites), = a["records"]
        assert source == "pass" and [p for p, _ in sites] == ["one_stage", "unfused"]
        assert "no RMSNorm after the all-reduce" in sites[1][1]
        # The cached graph: the pass did not run, the fused op reported its site.
        (source, total, sites), = b["records"]
        assert (source, total) == ("cache", 2) and [p for p, _ in sites] == ["one_stage"]
        for got, want in zip(b["out"], b["eager"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Written as JSON lines too, and read back as one record per graph and rank.
    read = records.read_dir(str(tmp_path / "records"))
    assert sorted((g.rank, g.source, len(g.sites)) for g in read) == [
        (0, "cache", 1), (0, "pass", 2), (1, "cache", 1), (1, "pass", 2)]

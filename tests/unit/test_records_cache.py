"""A graph loaded from Inductor's compile cache still says what it fused.

The post-grad pass never runs on an FX-graph-cache hit; the fused ops carry their
site records and report them on their first call.  Two runs of fresh processes
share one cache directory: the first compiles (records from the pass), the second
hits the cache (records from the ops, ``source="cache"``).  A site's record is
the same whenever the same graph compiles, so the code is too.
"""

from __future__ import annotations

import torch

from fusion_pass.testing.spawn import run_ranks

HIDDEN = 64


def _model(rank: int, norm_after_second: bool = False) -> tuple:
    """A block of two all-reduces, the first into an RMSNorm; the second into another
    (two equal fused sites) or into a multiply that leaves the graph (recorded, not
    fused); its inputs."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    w = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN), requires_grad=False)

    def norm(h):
        v = h.float()
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    def block(x, r):
        h = fc.all_reduce(x, "sum", group) + r
        y = norm(h)
        if norm_after_second:
            return norm(fc.all_reduce(y, "sum", group) + h)
        s = fc.all_reduce(y, "sum", group) * 2  # no norm in this graph: recorded, not fused
        return y, h, s

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(rank))
    r = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    return block, x, r


def _compile_and_run(rank: int, world_size: int) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import config

    from fusion_pass import AllReduceRMSNormFusionPass, records

    block, x, r = _model(rank)
    config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
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
        assert sites[1][1].startswith("no RMSNorm after the all-reduce in this graph")
        # The cached graph: the pass did not run, the fused op reported its site.
        (source, total, sites), = b["records"]
        assert (source, total) == ("cache", 2) and [p for p, _ in sites] == ["one_stage"]
        for got, want in zip(b["out"], b["eager"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Written as JSON lines too, and read back as one record per graph and rank.
    read = records.read_dir(str(tmp_path / "records"))
    assert sorted((g.rank, g.source, len(g.sites)) for g in read) == [
        (0, "cache", 1), (0, "pass", 2), (1, "cache", 1), (1, "pass", 2)]


def _compile_twice(rank: int, world_size: int) -> dict:
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from fusion_pass import AllReduceRMSNormFusionPass, records

    block, x, r = _model(rank, norm_after_second=True)
    config.post_grad_custom_post_pass = AllReduceRMSNormFusionPass()
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
            "reported": reported, "seen": len(records.ran)}


def test_the_same_graph_compiles_to_the_same_code() -> None:
    """Compiled twice in fresh dynamo state, with Inductor's caches off (the pass runs
    both times): the same output code and ``site`` arguments, no random id; the op
    hands each site to the records once, however often it runs."""
    for rank in run_ranks(_compile_twice, 2):
        first, second = rank["codes"]
        assert first == second
        # Two fused sites, each carrying its record.
        assert first.count("torch.ops.fusion_pass.allreduce_rmsnorm.default(") == 2, first
        assert first.count('"path": "one_stage"') == 2, first
        assert len(set(rank["ids"])) == 1 and len(rank["ids"]) == 2
        # The op hands each site to the records once, however often it runs.
        assert rank["reported"] == [] and rank["seen"] == 2


def test_graphs_of_equal_text_but_other_inputs_get_other_ids() -> None:
    """A graph's text names no dtype or shape: the id must see its inputs too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_pass import records

    def f(x):
        return x * 2

    a = make_fx(f)(torch.ones(4, 8, dtype=torch.bfloat16)).graph
    b = make_fx(f)(torch.ones(16, 8, dtype=torch.float32)).graph
    assert str(a) == str(b)
    ids = [records.new_graph_record("from graph shapes", g).uuid for g in (a, a, b)]
    assert ids[0] == ids[1] != ids[2]


def test_a_sites_path_is_typed_and_reads_back_as_its_name(tmp_path) -> None:
    """``SiteRecord.path`` is a ``SitePath``: written as its name, read back as the member,
    equal to and hashed as the name (counts keyed by it look up by the JSON's string);
    a name that is no path is refused."""
    import json

    import pytest

    from fusion_pass import records

    site = records.site_record("c10d_functional", None, 2, None, "one_stage", "fits",
                               "reference", "0", norm="native_plain")
    assert site.path is records.SitePath.ONE_STAGE and site.tokens == "unknown"
    back = records.SiteRecord(**json.loads(json.dumps(site.__dict__)))
    assert back == site and back.path is records.SitePath.ONE_STAGE and back.fused
    assert {records.SitePath.UNFUSED: 1} == {"unfused": 1}
    with pytest.raises(ValueError):
        records.SiteRecord(**{**site.__dict__, "path": "triton_one_stage"})

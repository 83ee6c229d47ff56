"""The op's per-signature routes (the eager fast path): same results and decisions as
deciding every call afresh, the same errors, and nothing stale after a change."""

from __future__ import annotations

import pytest
import torch

from fusion_pass.spec import NormSpec
from fusion_pass.testing.spawn import run_ranks

from test_op import declining_backend, make_inputs, said


def _echo_backend():
    """A fused backend computed by the reference, which records what it was asked."""
    import fusion_pass
    from fusion_pass.backends import Outputs, reference

    class Echo:
        name = "echo"
        limits = fusion_pass.gate.UNLIMITED
        asked: list = []

        def run(self, call):
            Echo.asked.append((call.hidden, call.tokens, str(call.x.dtype), call.path.value,
                               call.residual is None, str(call.out_dtype), call.spec.gemma))
            y, h = reference.add_rms_norm(reference.all_reduce(call.x, call.group_name),
                                          call.residual, call.weight, call.spec, call.eps)
            return Outputs(y, h)

    return Echo


# (tokens, hidden, dtype, residual, path, out_dtype, gemma), interleaved and repeated so that
# every signature is met again after others: a stale route would show.
SIGNATURES = [
    (8, 64, torch.bfloat16, True, "auto", None, False),
    (100, 64, torch.bfloat16, True, "auto", None, False),     # two-stage by the 80 threshold
    (8, 64, torch.bfloat16, False, "auto", None, False),      # residual None
    (8, 64, torch.float16, True, "auto", None, False),        # dtype
    (8, 64, torch.bfloat16, True, "two_stage", None, False),  # baked path
    (8, 64, torch.bfloat16, True, "unfused", None, False),    # the reference, backend not asked
    (8, 64, torch.bfloat16, True, "auto", torch.float32, False),  # out_dtype
    (8, 64, torch.bfloat16, True, "auto", None, True),        # gemma
    (8, 72, torch.bfloat16, True, "auto", None, False),       # hidden (still 16-byte rows)
    (8, 60, torch.bfloat16, True, "auto", None, False),       # 120-byte rows: the gate says unfused
    (0, 64, torch.bfloat16, True, "auto", None, False),       # empty: never kept
]


def _run_signatures(rank: int, fresh: bool) -> tuple[list, list, int]:
    """Outputs and the backend's record of SIGNATURES x 3 on distinct data; with
    ``fresh`` every call decides afresh (the routes are forgotten before it)."""
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends, op

    group = dist.group.WORLD.group_name
    echo = _echo_backend()
    name = f"echo-{'fresh' if fresh else 'kept'}"  # get() keeps a name's first instance
    backends.register(name, echo)
    backends.set_backend(name)
    checked = 0
    real_check = op._check

    def counting_check(*args):
        nonlocal checked
        checked += 1
        return real_check(*args)

    op._check = counting_check
    outs = []
    try:
        for rep in range(3):
            for i, signature in enumerate(SIGNATURES):
                tokens, hidden, dtype, residual, path, out_dtype, gemma = signature
                if fresh:
                    op._routes.clear()
                x, r, w = make_inputs(rank, tokens, hidden, dtype, seed=10 * rep + i)
                outs.append(fusion_pass.fused_allreduce_rmsnorm(
                    x, w, 1e-6, group, residual=r if residual else None, path=path,
                    gemma=gemma, out_dtype=out_dtype))
    finally:
        op._check = real_check
        backends.set_backend(None)
    return outs, echo.asked, checked


def _routes_case(rank: int, world_size: int) -> dict:
    kept = _run_signatures(rank, fresh=False)
    fresh = _run_signatures(rank, fresh=True)
    return {"kept": kept, "fresh": fresh}


@pytest.fixture(scope="module")
def routes_results():
    return run_ranks(_routes_case, 2)


def test_kept_routes_give_the_same_tensors_and_decisions_as_fresh_ones(routes_results) -> None:
    for res in routes_results:
        (kept, kept_asked, _), (fresh, fresh_asked, _) = res["kept"], res["fresh"]
        assert len(kept) == len(fresh) == 3 * len(SIGNATURES)
        for (ky, kh), (fy, fh) in zip(kept, fresh):
            assert ky.dtype == fy.dtype and kh.dtype == fh.dtype
            assert torch.equal(ky, fy) and torch.equal(kh, fh)
        assert kept_asked == fresh_asked


def test_each_signature_is_asked_as_decided(routes_results) -> None:
    asked = routes_results[0]["kept"][1]
    once = [
        (64, 8, "torch.bfloat16", "one_stage", False, "torch.bfloat16", False),
        (64, 100, "torch.bfloat16", "two_stage", False, "torch.bfloat16", False),
        (64, 8, "torch.bfloat16", "one_stage", True, "torch.bfloat16", False),
        (64, 8, "torch.float16", "one_stage", False, "torch.float16", False),
        (64, 8, "torch.bfloat16", "two_stage", False, "torch.bfloat16", False),
        (64, 8, "torch.bfloat16", "one_stage", False, "torch.float32", False),
        (64, 8, "torch.bfloat16", "one_stage", False, "torch.bfloat16", True),
        (72, 8, "torch.bfloat16", "one_stage", False, "torch.bfloat16", False),
    ]  # unfused, 120-byte rows and the empty batch: the backend is not asked
    assert asked == once * 3


def test_a_kept_route_skips_the_checks(routes_results) -> None:
    """The checks run on a signature's first call only (and on every empty batch,
    which keeps no route); deciding afresh runs them on every call."""
    kept_checked, fresh_checked = routes_results[0]["kept"][2], routes_results[0]["fresh"][2]
    assert fresh_checked == 3 * len(SIGNATURES)
    assert kept_checked == len(SIGNATURES) + 2


def _value_errors(calls: dict) -> dict:
    """Per name: the ValueError message the call raised, or None."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _errors_case(rank: int, world_size: int) -> dict:
    """Bad calls after the same good signature has been warmed up."""
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import op

    group = dist.group.WORLD.group_name
    x, r, w = make_inputs(rank, 5, 64, torch.bfloat16)
    for _ in range(3):
        fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
    warm = len(op._routes)
    errors = _value_errors({
        "weight": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w[:10], 1e-6, group, residual=r),
        "weight_2d": lambda: fusion_pass.fused_allreduce_rmsnorm(
            x, w.view(1, 64), 1e-6, group, residual=r),
        "weight_int": lambda: fusion_pass.fused_allreduce_rmsnorm(
            x, w.to(torch.int32), 1e-6, group, residual=r),
        "residual_shape": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group,
                                                                      residual=r[:2]),
        "residual_dtype": lambda: fusion_pass.fused_allreduce_rmsnorm(
            x, w, 1e-6, group, residual=r.half()),
        "out_dtype": lambda: fusion_pass.fused_allreduce_rmsnorm(
            x, w, 1e-6, group, residual=r, out_dtype=torch.int8),
        "path": lambda: fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r,
                                                            path="fast"),
        "eps_tensor": lambda: fusion_pass.fused_allreduce_rmsnorm(
            x, w, torch.ones(2), group, residual=r),
    })
    from fusion_pass.quant import QuantSpec

    static = QuantSpec("static")
    x2, r2, w2 = make_inputs(rank, 4, 256, torch.bfloat16)
    for _ in range(2):
        fusion_pass.fused_allreduce_rmsnorm_quant(x2, w2, 1e-6, group, static,
                                                  torch.tensor([0.02]), residual=r2)
    errors.update(_value_errors({
        "no_scale": lambda: fusion_pass.fused_allreduce_rmsnorm_quant(
            x2, w2, 1e-6, group, static, None, residual=r2),
        "two_scales": lambda: fusion_pass.fused_allreduce_rmsnorm_quant(
            x2, w2, 1e-6, group, static, torch.tensor([0.02, 0.03]), residual=r2),
        "groups": lambda: fusion_pass.fused_allreduce_rmsnorm_quant(
            x2[:, :192], w2[:192], 1e-6, group, QuantSpec("per_group", group=128),
            residual=r2[:, :192].contiguous()),
    }))
    # A non-contiguous input after the contiguous one is warm: the reference, said once.
    xt = torch.randn(64, 5).to(torch.bfloat16).t()
    rt = r.t().contiguous().t()
    from fusion_pass import backends

    Fused = declining_backend("fused-test", "declines (test)")  # limits would take anything

    backends.register("fused-test", Fused)
    backends.set_backend("fused-test")
    try:
        with said() as messages:
            fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
            for _ in range(2):
                fusion_pass.fused_allreduce_rmsnorm(xt, w, 1e-6, group, residual=rt)
    finally:
        backends.set_backend(None)
    return {"warm": warm, "errors": errors, "said": messages, "fused_ran": Fused.calls,
            "routes_after": len(op._routes)}


def test_bad_input_raises_after_the_good_signature_is_warm() -> None:
    res = run_ranks(_errors_case, 2)[0]
    assert res["warm"] >= 1
    e = res["errors"]
    assert "weight of shape (10,)" in e["weight"]
    assert "weight of shape (1, 64)" in e["weight_2d"]
    assert "must be floating point" in e["weight_int"]
    assert "residual (2, 64)" in e["residual_shape"]
    assert "residual (5, 64) torch.float16" in e["residual_dtype"]
    assert "out_dtype must be one of" in e["out_dtype"]
    assert "path must be one of" in e["path"]
    assert "eps must hold one float" in e["eps_tensor"]
    assert "takes a scale tensor" in e["no_scale"]
    assert "one element, not 2" in e["two_scales"]
    assert "whole number of 128-element groups" in e["groups"]
    # The contiguous call reached the backend (and was declined); the transposed one
    # never did: it fell back for being non-contiguous, said once.
    assert res["fused_ran"] == 1
    falls = [m for m in res["said"] if "falls back" in m]
    assert len(falls) == 2 and "declines (test)" in falls[0]
    assert "non-contiguous input" in falls[1]


def _regroup_case(rank: int, world_size: int) -> dict:
    """A route made for the world group of 2, then the group destroyed and a group of 1
    made under the same name on rank 0: the same signature must see world size 1."""
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends, op
    from fusion_pass.groups import c10d_world_size

    echo = _echo_backend()
    backends.register("echo", echo)
    backends.set_backend("echo")
    out: dict = {}
    try:
        name = dist.group.WORLD.group_name
        x, r, w = make_inputs(rank, 8, 64, torch.bfloat16)
        for _ in range(2):
            out["two"] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, name, residual=r)
        out["asked_two"] = list(echo.asked)
        out["routes_two"] = len(op._routes)
        dist.destroy_process_group()
        if rank == 0:
            dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
            out["same_name"] = dist.group.WORLD.group_name == name
            out["size"] = c10d_world_size(name)
            with said() as messages:
                for _ in range(2):
                    out["one"] = fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, name, residual=r)
            out["asked_one"] = echo.asked[len(out["asked_two"]):]
            out["said_one"] = messages
    finally:
        backends.set_backend(None)
    return out


def test_a_group_destroyed_and_made_again_with_another_size_is_seen() -> None:
    res = run_ranks(_regroup_case, 2)[0]
    assert res["routes_two"] >= 1
    assert res["asked_two"] == [(64, 8, "torch.bfloat16", "one_stage", False,
                                 "torch.bfloat16", False)] * 2
    assert res["same_name"] and res["size"] == 1
    assert res["asked_one"] == []  # world size 1: nothing to reduce, the reference runs
    x, r, w = make_inputs(0, 8, 64, torch.bfloat16)
    from fusion_pass.backends import reference

    y, h = reference.add_rms_norm(x, r, w, NormSpec(eps=1e-6))
    assert torch.equal(res["one"][0], y) and torch.equal(res["one"][1], h)
    assert any("world size 1" in m for m in res["said_one"])


def _limits_case(rank: int, world_size: int) -> dict:
    """New backend limits (a backend given other schedules) and a new backend selection
    both reach a signature whose route is kept."""
    import torch.distributed as dist

    import fusion_pass
    from fusion_pass import backends, gate

    group = dist.group.WORLD.group_name
    echo = _echo_backend()
    backends.register("echo", echo)
    backends.set_backend("echo")
    x, r, w = make_inputs(rank, 8, 64, torch.bfloat16)
    paths = []
    try:
        fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
        echo.limits = gate.BackendLimits(name="echo", one_stage_max_tokens=4)
        fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
        paths = [a[3] for a in echo.asked]
        other = _echo_backend()
        backends.register("echo-2", other)
        backends.set_backend("echo-2")
        fusion_pass.fused_allreduce_rmsnorm(x, w, 1e-6, group, residual=r)
    finally:
        backends.set_backend(None)
    return {"paths": paths, "other_asked": len(other.asked), "echo_asked": len(echo.asked)}


def test_new_limits_and_a_new_backend_are_seen_by_a_kept_signature() -> None:
    res = run_ranks(_limits_case, 2)[0]
    assert res["paths"] == ["one_stage", "two_stage"]
    assert res["other_asked"] == 1 and res["echo_asked"] == 2


def test_world_size_follows_a_group_made_again_under_the_same_name() -> None:
    """In one process: gloo of 1, then a fake group of 4, then gloo of 1, all named "0"."""
    code = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from fusion_pass.groups import c10d_world_size
sizes = []
for backend, size, store in (("gloo", 1, dist.HashStore()), ("fake", 4, FakeStore()),
                             ("gloo", 1, dist.HashStore())):
    dist.init_process_group(backend, rank=0, world_size=size, store=store)
    name = dist.group.WORLD.group_name
    sizes += [name, c10d_world_size(name), c10d_world_size(name)]
    dist.destroy_process_group()
try:
    c10d_world_size(name)
    sizes.append("resolved")
except RuntimeError:
    sizes.append("gone")
print(sizes)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(["0", 1, 1, "0", 4, 4, "0", 1, 1, "gone"])


def test_anything_tracing_goes_through_the_dispatcher() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import fusion_pass
    from fusion_pass import op

    x = torch.randn(4, 64)
    assert op._eager(x)

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        assert not op._eager(x)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert not op._eager(fx)
        # The fake kernel: shapes only, no process group needed.
        y, h = fusion_pass.fused_allreduce_rmsnorm(fx, torch.ones(64), 1e-6, "no-such-group",
                                                   residual=fx, out_dtype=torch.bfloat16)
        assert y.shape == h.shape == (4, 64) and y.dtype == torch.bfloat16

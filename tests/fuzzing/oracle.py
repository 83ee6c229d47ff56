"""The oracle: one generated case compiled with and without the pass, on rank 0 of a pair.

:func:`check_case` runs on the leader (rank 0).  Before each run of the case's
function it asks its :class:`Peer` (rank 1) to run the same case, so every
all-reduce has a real second contribution: rank 1's own ``x`` and the same
residual, as a tensor-parallel peer has.  Where the case has one all-reduce the
peer runs the function eagerly: the pass rewrites every rank's graph the same way,
so an eager peer contributes what a compiled one would, at a fraction of the cost.
Where it has more, the peer compiles the case as the leader does: Inductor may
issue independent collectives in another order than the source (and the merge
option changes them), and ranks must meet in the same order.

A case is wrong when

* the outputs with the pass differ from those without it beyond the dtype's
  tolerance (FP8 codes beyond that tolerance and one step);
* an all-reduce in the graph has no record, or the graph's fused ops do not
  match the sites recorded fused one for one;
* the pass changed a graph in which it fused nothing and merged nothing;
* the compile with the pass raised where the compile without it did not.

A case torch cannot compile without the pass either, or whose eager run raises,
is invalid: it says nothing of the pass.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Optional, Protocol

from . import collectives

DTYPES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}
"""Tolerance per dtype (test_pass.py's for fp32 and bf16); atol is twice it."""

EAGER, ON, OFF = 0, 1, 2
"""How a peer runs a case: eagerly, or compiled with or without the pass."""


class PairBroken(Exception):
    """The ranks no longer meet in the same collectives (a run that issued fewer than
    the peer waits for, a collective that failed or timed out): the pair must start
    again.  Carries the case's verdict."""

    def __init__(self, verdict: dict) -> None:
        super().__init__(verdict["why"])
        self.verdict = verdict


class Peer(Protocol):
    def run(self, seed: int, mode: int) -> None:
        """Have rank 1 run case ``seed`` in ``mode`` (it returns at once; rank 1 then
        waits in the case's collectives for this rank)."""

    def result(self) -> int:
        """Rank 1's answer once its run is over: the collectives it issued."""


def load(source: str, name: str) -> dict:
    """The case's namespace, with the ranks' groups filled in (a fresh code object for
    each ``name``: Dynamo then holds nothing of an earlier compile)."""
    import torch.distributed as dist

    ns: dict[str, Any] = {"__name__": name}
    exec(compile(source, name, "exec"), ns)
    ns["GROUP"] = dist.group.WORLD
    ns["GROUP_NAME"] = dist.group.WORLD.group_name
    if ns["NEEDS_VLLM"]:
        ns["TP"] = _vllm_tp_group()
    return ns


def _vllm_tp_group() -> Optional[str]:
    """vLLM's TP group's name where this process set vLLM's groups up, else None."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group().unique_name


def _fused_ops(graph) -> list:
    return [n for n in graph.nodes if n.op == "call_function"
            and str(getattr(n.target, "namespace", "")) == "fusion_pass"]


def _counting(pass_obj: Any, seen: dict) -> Any:
    """``pass_obj`` with what it saw and did written into ``seen``."""
    import torch

    def all_reduces(graph) -> int:
        return sum(1 for n in graph.nodes if n.op == "call_function" and (
            n.target is torch.ops._c10d_functional.all_reduce.default
            or str(n.target) == "vllm.all_reduce.default"))

    class Counting(type(pass_obj)):
        def __call__(self, graph):
            seen["calls"] += 1
            seen["before"] = str(graph)
            seen["ars"] = all_reduces(graph)
            super().__call__(graph)
            seen["after"] = str(graph)
            seen["fused_ops"] = len(_fused_ops(graph))

    hook = Counting.__new__(Counting)
    hook.__dict__.update(pass_obj.__dict__)
    return hook


def make_pass(ns: dict, sabotage: Optional[str] = None) -> Any:
    """The pass with the case's options, or a sabotaged one (:data:`SABOTAGES`)."""
    from fusion_pass import AllReduceRMSNormFusionPass

    cls = _sabotaged_pass_class(sabotage) if sabotage else AllReduceRMSNormFusionPass
    return cls(**ns["PASS_OPTIONS"])


def compile_run(ns: dict, args: tuple, pass_obj: Any) -> dict:
    """One compile of ``ns['f']`` with ``pass_obj`` as the post-grad custom pass (or
    None) on fresh Dynamo state: its outputs, and what the pass saw and did."""
    import torch
    from torch._inductor import config

    from fusion_pass import records

    seen: dict[str, Any] = {"calls": 0}
    hook = _counting(pass_obj, seen) if pass_obj is not None else None
    start = len(records.HISTORY)
    torch._dynamo.reset()
    dyn = ns["DYNAMIC"]
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    if dyn == "mark":
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
    elif dyn == "true":  # weights static, as a module's parameters are
        for a in args[3:5]:
            torch._dynamo.mark_static(a)
    with config.patch(post_grad_custom_post_pass=hook):
        assert config.post_grad_custom_post_pass is hook
        fn = torch.compile(ns["f"], fullgraph=True,
                           dynamic={"mark": None, "static": False, "true": True}[dyn])
        out = fn(*args)
    seen["records"] = records.HISTORY[start:]
    seen["out"] = out
    return seen


def eager_run(ns: dict, args: tuple) -> Any:
    import torch

    return ns["f"](*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))


def compare(a: Any, b: Any, dt_name: str) -> Optional[str]:
    """None when output ``a`` matches ``b`` within the case's tolerance, else why not."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    tol = max(DTYPES[dt_name], DTYPES.get(str(a.dtype).replace("torch.", ""), 0))
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        # Codes are y over a scale: the float comparison's tolerances on y, in codes, and
        # one e4m3 step (at most 1/8 of the larger code) for a y that rounds the other way.
        fa, fb = a.float(), b.float()
        atol = 2 * tol * float(fb.abs().max()) + 2.0 ** -9
        bad = (fa - fb).abs() > (0.125 + tol) * torch.maximum(fa.abs(), fb.abs()) + atol
        bad &= ~(fa.isnan() & fb.isnan())
        if bad.any():
            return (f"{int(bad.sum())} FP8 codes differ beyond a step and {atol:.3g}: "
                    f"{fa[bad][:4].tolist()} vs {fb[bad][:4].tolist()}")
        return None
    if not a.dtype.is_floating_point:
        return None if torch.equal(a, b) else "integer outputs differ"
    fa, fb = a.double(), b.double()
    scale = max(1.0, float(fb[fb.isfinite()].abs().max()) if fb.isfinite().any() else 1.0)
    try:
        torch.testing.assert_close(fa, fb, rtol=tol, atol=2 * tol * scale, equal_nan=True)
    except AssertionError as e:
        return " ".join(str(e).split("\n")[:4])
    return None


def compare_all(outs_a: Any, outs_b: Any, dt_name: str) -> list[str]:
    if len(outs_a) != len(outs_b):
        return [f"{len(outs_a)} outputs vs {len(outs_b)}"]
    found = []
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        why = compare(a, b, dt_name)
        if why is not None:
            found.append(f"output {i}: {why}")
    return found


SABOTAGES = {
    "eps": "every fused op's epsilon raised by 1",
    "fail_after": "each fused op's y read by an op that raises when it runs",
    "no_all_reduce": "every functional all-reduce dropped (its input taken as its sum)",
}
"""Passes that are wrong on purpose: what the oracle must call wrong (its own test)."""


_fail_lib: list = []


def _fail_at_run_op() -> Any:
    """``fuzz_oracle::fail_at_run(t)``: raises when it runs (its fake returns ``t``'s like)."""
    import torch

    if not _fail_lib:
        lib = torch.library.Library("fuzz_oracle", "DEF")
        lib.define("fail_at_run(Tensor t) -> Tensor")

        def fail_at_run(t):
            raise RuntimeError("fail_at_run: the sabotaged graph ran this op")

        lib.impl("fail_at_run", fail_at_run, "CPU")
        torch.library.register_fake("fuzz_oracle::fail_at_run", torch.empty_like, lib=lib)
        _fail_lib.append(lib)
    return torch.ops.fuzz_oracle.fail_at_run.default


def _sabotage_eps(graph: Any, node: Any) -> None:
    """Epsilon plus one in the fused call ``node``, a literal or a tensor."""
    import dataclasses

    import torch

    from fusion_pass import op
    from fusion_pass.spec import NormSpec

    a = op.arguments(node.args, node.kwargs)
    spec = NormSpec.decode(a["spec"])
    if spec.takes("eps"):
        with graph.inserting_before(node):
            more = graph.call_function(torch.ops.aten.add.Tensor, (a["eps"], 1.0))
        more.meta["val"] = a["eps"].meta.get("val")
        node.replace_input_with(a["eps"], more)
    else:
        node.update_arg([n for n, _ in op.ARGS].index("spec"),
                        dataclasses.replace(spec, eps=spec.eps + 1.0).encode())


def _sabotaged_pass_class(kind: str) -> type:
    import operator

    from fusion_pass import AllReduceRMSNormFusionPass

    import torch

    c10d = torch.ops._c10d_functional

    class Sabotaged(AllReduceRMSNormFusionPass):
        def __call__(self, graph):
            if kind == "no_all_reduce":
                for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default]:
                    ar = wait.args[0]
                    if ar.target is c10d.all_reduce.default:
                        wait.replace_all_uses_with(ar.args[0])
                        graph.erase_node(wait)
                        graph.erase_node(ar)
            super().__call__(graph)
            for n in _fused_ops(graph) if kind != "no_all_reduce" else []:
                if kind == "eps":
                    _sabotage_eps(graph, n)
                    continue
                y = min((u for u in n.users if u.target is operator.getitem),
                        key=lambda u: u.args[1])
                with graph.inserting_after(y):
                    failing = graph.call_function(_fail_at_run_op(), (y,))
                failing.meta["val"] = y.meta.get("val")
                y.replace_all_uses_with(failing, delete_user_cb=lambda u: u is not failing)

    return Sabotaged


def peer_mode(ns: dict, mode: int) -> int:
    """How the peer runs a case the leader runs in ``mode``: eagerly where the case has
    one all-reduce; as the leader does where it has more, since Inductor may order
    independent collectives otherwise than the source does (and the merge option
    changes them)."""
    return mode if ns["ALL_REDUCES"] > 1 else EAGER


def _record_problems(on: dict, written: int) -> list[str]:
    """What the records, the graph and the case's source (``written`` all-reduces) say
    against each other."""
    problems = []
    sites = [s for g in on["records"] for s in g.sites]
    fused = sum(s.fused for s in sites)
    merged = sum(s.reason.startswith("merged into") for s in sites)
    if on["calls"] != 1 or len(on["records"]) != 1:
        problems.append(f"the pass ran {on['calls']} time(s), {len(on['records'])} graph record(s)")
    elif not len(sites) == on["ars"] == written:
        problems.append(f"{written} all-reduce(s) in the source, {on['ars']} in the graph the "
                        f"pass saw, {len(sites)} record(s)")
    if on.get("fused_ops", 0) != fused:
        problems.append(f"{fused} site(s) recorded fused, {on.get('fused_ops')} fused op(s) in the graph")
    if fused == 0 and merged == 0 and on.get("before") != on.get("after"):
        problems.append("no site fused or merged but the graph changed")
    return problems


def check_case(source: str, name: str, peer: Peer, seed: int, always_baseline: bool = False,
               sabotage: Optional[str] = None) -> dict:
    """Run one case on the leader: ``{"status", "fused", "sites", "why", ...}``, status
    one of fused, unfused, wrong, invalid, skipped.

    A graph the pass left exactly as it was is what Inductor compiles without the pass,
    so the second compile is skipped there unless ``always_baseline``."""
    import torch.distributed as dist

    ns = load(source, name)
    if ns["NEEDS_VLLM"] and ns["TP"] is None:
        return dict(status="skipped", why="the case uses vLLM's ops and vLLM is not set up here",
                    fused=0, sites=0)
    args = ns["make_inputs"](dist.get_rank())
    dt_name = str(ns["DT"]).replace("torch.", "")

    def paired(ns: dict, mode: int) -> Any:
        """This rank's run of the case in ``mode`` while the peer runs it too (eagerly, or
        compiled as here: :func:`peer_mode`); then the peer's answer.

        An eager peer issues the case's all-reduces, no more, no fewer.  A compile that
        fails issues none and leaves the peer waiting in the first: an eager run here
        releases it.  A run that issued fewer than the peer waits for, or a collective
        that failed, ends the pair (:class:`PairBroken`); so does a compiled peer left
        anywhere but where this rank is."""
        pm = peer_mode(ns, mode)
        peer.run(seed, pm)
        start = collectives.issued()
        error = None
        try:
            result = eager_run(ns, args) if mode == EAGER else \
                compile_run(ns, args, make_pass(ns, sabotage) if mode == ON else None)
        except Exception as e:  # noqa: BLE001
            error = e
        mine = collectives.issued() - start
        what = ("the eager run", "the compile with the pass", "the compile without it")[mode]
        if isinstance(error, dist.DistBackendError):
            broken(mode, f"a collective of {what} failed or timed out: {error}")
        if error is not None and mine == 0 and pm == EAGER and mode != EAGER:
            eager_run(ns, args)
            mine = collectives.issued() - start
        if pm == EAGER and mode != EAGER and mine != ns["ALL_REDUCES"]:
            broken(mode, f"{what} issued {mine} all-reduce(s), the case has "
                         f"{ns['ALL_REDUCES']}" + (f"; it raised:\n{_tail(error)}" if error else ""))
        if pm != EAGER and error is not None and mine > 0:
            broken(mode, f"{what} raised after {mine} collective(s) while the peer compiled "
                         f"it too:\n{_tail(error)}")
        theirs = peer.result()
        if theirs != mine:
            broken(mode, f"in {what} this rank issued {mine} all-reduce(s), the peer {theirs}")
        if error is not None:
            raise error
        return result

    def broken(mode: int, why: str) -> None:
        raise PairBroken(dict(status="invalid" if mode == OFF else "wrong", fused=0, sites=0,
                              why=why))

    try:
        eager = paired(ns, EAGER)  # the generator's own check: the code runs
    except PairBroken:
        raise
    except Exception as e:  # noqa: BLE001
        return dict(status="invalid", why=f"eager: {type(e).__name__}: {e}", fused=0, sites=0)
    t0 = time.perf_counter()
    try:
        on = paired(ns, ON)
    except PairBroken:
        raise
    except Exception as e:  # noqa: BLE001
        raised = _tail(e)
        try:  # torch itself may not compile the case: then it says nothing of the pass
            paired(load(source, name + "_off"), OFF)
        except PairBroken:
            raise
        except Exception as e:  # noqa: BLE001
            return dict(status="invalid", fused=0, sites=0,
                        why=f"torch does not compile it: {type(e).__name__}: {str(e)[:300]}")
        return dict(status="wrong", why="compile with the pass raised:\n" + raised,
                    fused=0, sites=0)
    t1 = time.perf_counter()
    problems = _record_problems(on, ns["ALL_REDUCES"])
    sites = [s for g in on["records"] for s in g.sites]
    fused = sum(s.fused for s in sites)
    recs = "; ".join(f"{s.norm}:{s.path}:{s.reason}" for s in sites)
    verdict = dict(fused=fused, sites=len(sites), records=recs, t_on=t1 - t0, t_off=0.0)
    if on["before"] == on["after"] and not always_baseline:
        return dict(verdict, status="wrong" if problems else "unfused", why="\n".join(problems))
    try:
        off = paired(load(source, name + "_off"), OFF)
    except PairBroken:
        raise
    except Exception as e:  # noqa: BLE001
        return dict(verdict, status="invalid", why="compile without the pass raised:\n" + _tail(e))
    verdict["t_off"] = time.perf_counter() - t1
    if off["records"]:
        problems.append("the compile without the pass recorded sites")
    differ = compare_all(on["out"], off["out"], dt_name)
    if differ:
        # Which of the two compiles eager agrees with says where to look.
        agrees = [n for n, o in (("with", on), ("without", off))
                  if not compare_all(o["out"], eager, dt_name)]
        problems += differ + [f"eager agrees with the compile {' and '.join(agrees) or 'neither'} "
                              "the pass"]
    status = "wrong" if problems else ("fused" if fused else "unfused")
    return dict(verdict, status=status, why="\n".join(problems))


def _tail(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))[-3000:]


def serve(sources: dict) -> None:
    """Rank 1 of a pair: run what the leader asks for, and answer how it went, until it
    says stop."""
    from . import pair

    while True:
        seed, mode = pair.receive()
        if seed is None:
            return
        ns = load(sources[seed], f"fuzz_case_{seed}_peer_{mode}")
        args = ns["make_inputs"](1)
        start = collectives.issued()
        try:
            if mode == EAGER:
                eager_run(ns, args)
            else:
                compile_run(ns, args, make_pass(ns) if mode == ON else None)
        except Exception:  # noqa: BLE001  (the leader judges the case)
            pass
        pair.answer(collectives.issued() - start)

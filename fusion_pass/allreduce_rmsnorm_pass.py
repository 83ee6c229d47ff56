"""The Inductor post-grad pass: all-reduce -> (residual add) -> RMSNorm into one op.

Match, decide, replace: for every all-reduce site (:mod:`.patterns.collectives`)
whose value flows into an RMSNorm (:mod:`.patterns.rms_norm`), ask the gate for a
path with the static hidden size, the dtype and what the graph knows about the
token count, and, unless it says ``unfused``, replace the pair by one call of
``torch.ops.fusion_pass.allreduce_rmsnorm`` with the path baked in.  A site
that does not fit is left exactly as it was and its reason recorded.
"""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path as FsPath
from typing import Any, Optional

import sympy
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import backends, gate, records
from . import op as _op  # noqa: F401  (registers torch.ops.fusion_pass)
from .patterns import AllReduceSite, NormMatch, find_site, load_vllm_forms, match_norm
from .patterns.fx_utils import val

def _source_hash() -> str:
    """Every source of the package: matchers, gate, op and the backends' limits
    all shape what the pass writes into a graph."""
    root = FsPath(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


class AllReduceRMSNormFusionPass(CustomGraphPass):
    """Fuse all-reduce + RMSNorm; usable as ``post_grad_custom_post_pass``.

    ``threshold``: the largest token count for the one-stage kernel.
    ``token_range``: what the caller knows about the token count of the graphs
    it compiles (vLLM's compile range); by default read from the graph's shapes.
    """

    def __init__(self, threshold: int = gate.DEFAULT_TOKEN_THRESHOLD,
                 token_range: Optional[gate.TokenRange] = None) -> None:
        self.threshold = threshold
        self.token_range = token_range

    def uuid(self) -> str:
        """Changes with the code, the settings, the backends the op will use and
        the world size: decisions depend on all four, and the graph (the rest of
        Inductor's cache key) names process groups but not their sizes.
        (AITER's version, which sets its limits, is read once per process and
        not part of the key: reinstalling AITER needs a fresh Inductor cache.)"""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        chosen = {dev: backends.selected_name(dev) for dev in ("cuda", "cpu")}
        return hashlib.sha256(repr((
            _source_hash(), self.threshold, self.token_range, chosen, world,
        )).encode()).hexdigest()

    def compile_range(self) -> Optional[gate.TokenRange]:
        """The token range of the graph being compiled, when the caller knows it."""
        return self.token_range

    def __call__(self, graph: fx.Graph) -> None:
        load_vllm_forms()
        rng = self.compile_range()
        record = records.new_graph_record(str(rng) if rng is not None else "from graph shapes")
        for node in list(graph.nodes):
            if node._erased:  # removed by an earlier replacement
                continue
            site = find_site(node)
            if site is None:
                continue
            match = match_norm(site.out)
            if match is None:
                continue
            record.sites.append(self._fuse(graph, site, match, rng))
        if record.sites:
            graph.lint()
        records.emit(record)

    def _fuse(self, graph: fx.Graph, site: AllReduceSite, match: NormMatch,
              rng: Optional[gate.TokenRange]) -> records.SiteRecord:
        x = val(site.inp)
        w = val(match.weight)
        hidden = x.shape[-1] if x is not None else None
        backend_name = backends.selected_name(x.device.type if x is not None else "cpu")
        tokens = _tokens(x, rng) if x is not None else None

        def rec(decision: gate.Decision) -> records.SiteRecord:
            return records.SiteRecord(
                collective=site.form, norm=match.form,
                hidden=hidden if isinstance(hidden, int) else None,
                dtype=gate.dtype_name(x.dtype) if x is not None else None,
                world_size=site.world_size, tokens=_fmt_tokens(tokens),
                path=decision.path.value, reason=decision.reason,
                backend=backend_name, group=site.group_name)

        why = _unfit(site, match, x, w)
        at = _insertion_point(site, match) if why is None else None
        if why is None and at is None:
            why = "the norm's inputs are defined after a user of its outputs"
        if why is not None:
            return rec(gate.Decision(gate.Path.UNFUSED, why))
        decision = gate.decide(hidden, x.dtype, site.world_size, tokens,
                               limits=backends.get(backend_name).limits,
                               threshold=self.threshold)
        if decision.fused:
            _replace(graph, site, match, decision.path, at)
        return rec(decision)


def _unfit(site: AllReduceSite, match: NormMatch, x: Optional[torch.Tensor],
           w: Optional[torch.Tensor]) -> Optional[str]:
    """Why this match cannot be replaced safely, or None."""
    if x is None or w is None:
        return "no shape information on the graph"
    if not isinstance(x.shape[-1], int):
        return "hidden size is not static"
    if w.dtype != x.dtype:
        return f"norm weight is {w.dtype}, activations are {x.dtype}"
    if match.residual is not None:
        r = val(match.residual)
        if r is None or r.dtype != x.dtype or r.shape != x.shape:
            return "residual does not match the all-reduce input"
    replaced = match.nodes | set(site.nodes)
    for n in match.private | set(site.nodes) - {site.out}:
        if any(u not in replaced for u in n.users):
            return f"{n.name} has users outside the pattern"
    return None


def _insertion_point(site: AllReduceSite, match: NormMatch) -> Optional[fx.Node]:
    """The node before which the fused op can go: after its inputs, before any
    user of its outputs."""
    nodes = list(site.out.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [site.inp, match.weight] + ([match.residual] if match.residual is not None else [])
    first_use = min((order[u] for n in match.outputs for u in n.users if u not in match.nodes),
                    default=len(order))
    last_def = max(order[n] for n in inputs)
    earliest = min(order[n] for n in set(site.nodes) | match.nodes)
    at = max(last_def + 1, earliest)
    if at > first_use:
        return None
    return nodes[at]


def _replace(graph: fx.Graph, site: AllReduceSite, match: NormMatch, path: gate.Path,
             at: fx.Node) -> None:
    args = (site.inp, match.residual, match.weight, match.eps, site.group_name,
            path.value, match.gemma)
    fake = _fake_outputs(args)
    with graph.inserting_before(at):
        fused = graph.call_function(torch.ops.fusion_pass.allreduce_rmsnorm.default, args)
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
    if fake is not None:
        fused.meta["val"] = fake
        for i, o in enumerate(outs):
            o.meta["val"] = fake[i]
    replaced = match.nodes | set(site.nodes)
    for node, i in match.outputs.items():
        node.replace_all_uses_with(outs[i], delete_user_cb=lambda u: u not in replaced)
    _erase_dead(replaced)


def _erase_dead(candidates: set[fx.Node]) -> None:
    """Erase the replaced nodes, and what only they used (weight casts, ``1 + w``)."""
    pending = set(candidates)
    while pending:
        dead = [n for n in pending if not n.users and n.op == "call_function"]
        if not dead:
            break
        for n in dead:
            pending.discard(n)
            inputs = [i for i in n.all_input_nodes if i.op == "call_function" and not i.is_impure()]
            n.graph.erase_node(n)
            pending.update(i for i in inputs if not i.users)


def _fake_outputs(args: tuple[Any, ...]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    from torch._guards import detect_fake_mode

    vals = [val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return torch.ops.fusion_pass.allreduce_rmsnorm.default(*vals)


def _tokens(x: torch.Tensor, rng: Optional[gate.TokenRange]) -> gate.Tokens:
    """The token count of ``x`` as far as the graph and the caller know it."""
    n: Any = 1
    for d in x.shape[:-1]:
        n = n * d
    if isinstance(n, int):
        return n
    if rng is not None:
        # vLLM's range compiles leave the symbol unbounded: the caller's range rules.
        return rng
    try:
        node = n.node
        bounds = node.shape_env.bound_sympy(node.expr)
    except Exception:
        return None
    lo = int(bounds.lower) if isinstance(bounds.lower, sympy.Integer) else 1
    hi = int(bounds.upper) if isinstance(bounds.upper, sympy.Integer) else None
    return gate.TokenRange(max(lo, 0), hi)


def _fmt_tokens(tokens: gate.Tokens) -> str:
    return "unknown" if tokens is None else str(tokens)

"""The Inductor post-grad pass: all-reduce -> (residual add) -> RMSNorm [-> FP8 quant] into one op.

Match, decide, replace: for every all-reduce site (:mod:`.patterns.collectives`)
whose value flows into an RMSNorm (:mod:`.patterns.rms_norm`), and whose norm
output may feed a quantization (:mod:`.patterns.epilogue`), ask the gate for a
path with the static hidden size, the dtype and what the graph knows about the
token count, and, unless it says ``unfused``, replace the nodes by one call of
``torch.ops.fusion_pass.allreduce_rmsnorm`` (or ``..._quant``) with the path
baked in.  Every site gets a record: fused, fused already by vLLM's in-tree
pass, or left exactly as it was with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from pathlib import Path
from typing import Any, Optional

import sympy
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import backends, gate, op, records
from .backends.base import unfit_layout
from .patterns import (AllReduceSite, NormMatch, NormMiss, QuantMatch, fused_elsewhere,
                       find_site, load_vllm_forms, match_norm, match_quant, merge_quant)
from .patterns import layout
from .patterns.collectives import FusedElsewhere, SiteMiss
from .patterns.summed import Merged, merge_summed
from .patterns.fx_utils import val
from .spec import OUTPUTS, SCALARS


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """Every source of the package: matchers, gate, op and the backends' limits
    all shape what the pass writes into a graph (read once per process)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.json")):
        h.update(path.read_bytes())
    return h.hexdigest()


def merge_option(value: object) -> bool:
    """``merge_summed_all_reduces`` checked: a bool, never a truthy stand-in (``"no"``
    would merge, and change a rounding)."""
    if not isinstance(value, bool):
        raise TypeError(f"fusion_pass: merge_summed_all_reduces must be True or False, "
                        f"not {value!r}")
    return value


class AllReduceRMSNormFusionPass(CustomGraphPass):
    """Fuse all-reduce + RMSNorm (+ FP8 quant); usable as ``post_grad_custom_post_pass``.

    ``threshold``: forces one-stage up to that many tokens and two-stage above;
    None (default) uses the backend's token schedule (AITER: 80; Triton: the
    measured crossovers).  ``token_range``: what the caller knows about the
    token count of the graphs it compiles (vLLM's compile range); by default
    read from the graph's shapes.  ``merge_summed_all_reduces``: rewrite
    ``all_reduce(a) + all_reduce(b)`` (same group) into ``all_reduce(a + b)``
    before matching (:mod:`.patterns.summed`: one collective less, and a
    DeepSeek-V3-style routed + shared experts sum becomes fusable, at the price of
    one different rounding); off by default.
    """

    def __init__(self, threshold: Optional[int] = None,
                 token_range: Optional[gate.TokenRange] = None,
                 merge_summed_all_reduces: bool = False) -> None:
        self.threshold = threshold
        self.token_range = token_range
        self.merge_summed_all_reduces = merge_option(merge_summed_all_reduces)

    def uuid(self) -> str:
        """Changes with the code, the settings, the backends the op will use, their
        limits and the world size: decisions depend on all of them, and the graph
        (the rest of Inductor's cache key) names process groups but not their sizes."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        chosen = {dev: backends.selected_name(dev) for dev in ("cuda", "cpu")}
        return hashlib.sha256(repr((
            _source_hash(), self.threshold, self.token_range, self.merge_summed_all_reduces,
            chosen, world,
        )).encode()).hexdigest()

    def compile_range(self) -> Optional[gate.TokenRange]:
        """The token range of the graph being compiled, when the caller knows it."""
        return self.token_range

    def __call__(self, graph: fx.Graph) -> None:
        load_vllm_forms()
        rng = self.compile_range()
        record = records.new_graph_record(str(rng) if rng is not None else "from graph shapes",
                                          graph)
        training = _is_training_graph()
        fused: list[tuple[fx.Node, records.SiteRecord]] = []
        # Training graphs are left as they are, the merge's rounding included.
        merged = {} if training else self._merge(graph)
        for node in list(graph.nodes):
            if node._erased:  # removed by an earlier replacement
                continue
            elsewhere = fused_elsewhere(node)
            if elsewhere is not None:
                record.sites.append(_elsewhere_record(elsewhere, rng))
                continue
            site = find_site(node)
            if site is None:
                continue
            if isinstance(site, SiteMiss):
                record.sites.append(_miss_record(site, rng))
                continue
            site_record, op_node = self._site(graph, site, rng, training)
            record.sites.append(site_record)
            record.sites.extend(_merged_records(merged, site, site_record))
            if op_node is not None:
                fused.append((op_node, site_record))
        # The op carries its site's record (for compile-cache hits), written once
        # the graph's site count is known.
        for op_node, site_record in fused:
            op_node.update_kwarg("site", records.site_tag(record, site_record))
        if fused:
            graph.lint()
        records.emit(record)

    def _merge(self, graph: fx.Graph) -> dict[fx.Node, Merged]:
        """The summed all-reduces rewritten into one, by the new one's reduced value."""
        if not getattr(self, "merge_summed_all_reduces", False):  # pickled before the option
            return {}
        return {m.out: m for m in merge_summed(graph)}

    def _site(self, graph: fx.Graph, site: AllReduceSite, rng: Optional[gate.TokenRange],
              training: bool) -> tuple[records.SiteRecord, Optional[fx.Node]]:
        """Decide and (maybe) replace one all-reduce site: its record, and the fused op."""
        x = val(site.inp)
        tokens = _tokens(x, rng)
        match = match_norm(site.out)
        norm_form = match.form if isinstance(match, NormMatch) else None
        quant_note = ""
        if isinstance(match, NormMatch) and match.quant is None:
            q = match_quant(match)
            if isinstance(q, QuantMatch):
                match = merge_quant(match, q)
            elif q is not None:
                quant_note = f"; the FP8 quantization after it stays separate: {q.reason}"

        def rec(decision: gate.Decision) -> records.SiteRecord:
            m = match if isinstance(match, NormMatch) else None
            out_dt = m.out_dtype if m is not None and x is not None and m.out_dtype != x.dtype else None
            return records.site_record(
                site.form, x, site.world_size, tokens, decision.path,
                decision.reason + quant_note, _backend(x), site.group_name, norm=norm_form,
                quant=m.quant.spec.mode if m is not None and m.quant is not None else None,
                out_dtype=out_dt)

        if isinstance(match, NormMiss):
            why = match.reason
        else:
            why = _unfit(site, match, x, training)
        at = _insertion_point(site, match) if why is None else None
        if why is None and at is None:
            why = "the norm's inputs are defined after a user of its outputs"
        if why is not None:
            return rec(gate.Decision(gate.FusionPath.UNFUSED, why)), None
        assert isinstance(match, NormMatch) and x is not None
        spec = match.spec(x.dtype)
        group = spec.quant.group if spec.quant is not None and spec.quant.group else None
        decision = gate.decide(x.shape[-1], x.dtype, site.world_size, tokens,
                               limits=backends.get(_backend(x)).limits,
                               threshold=self.threshold, group_size=group,
                               features=spec.features())
        if not decision.fused:
            return rec(decision), None
        return rec(decision), _replace(graph, site, match, decision.path, at)


def _backend(x: Optional[torch.Tensor]) -> str:
    """The backend the op will run on for ``x``'s device."""
    return backends.selected_name(x.device.type if x is not None else "cpu")


def _miss_record(miss: SiteMiss, rng: Optional[gate.TokenRange]) -> records.SiteRecord:
    """The record of an all-reduce that is not a site the pass can fuse."""
    x = val(miss.at.args[0]) if miss.at is not None and miss.at.args else None
    return records.site_record(miss.form, x, miss.world_size, _tokens(x, rng),
                               records.SitePath.UNFUSED, miss.reason, _backend(x), "")


def _elsewhere_record(found: FusedElsewhere,
                      rng: Optional[gate.TokenRange]) -> records.SiteRecord:
    """The record of a site another pass fused."""
    x = val(found.inp)
    return records.site_record(found.form, x, found.world_size, _tokens(x, rng),
                               records.SitePath.VLLM_IN_TREE, found.reason, found.backend,
                               found.group_name, norm=found.norm, quant=found.quant)


def _merged_records(merged: dict[fx.Node, Merged], site: AllReduceSite,
                    kept: records.SiteRecord) -> list[records.SiteRecord]:
    """For a site made by merging all-reduces: the records of those merged away, one
    each (their sums now go wherever the kept one's goes)."""
    m = merged.get(site.out)
    if m is None:
        return []
    names = [m.kept, *m.removed]
    count = {2: "two", 3: "three"}.get(len(names), str(len(names)))
    owners = ", ".join(f"{n}'s" for n in names[:-1])
    kept.reason = (f"all-reduce of {owners} and {names[-1]}'s inputs summed (the {count} "
                   f"all-reduces merged into one): {kept.reason}")
    # No op runs for those merged away, so their records are not "fused".
    return [dataclasses.replace(kept, path=records.SitePath.UNFUSED, reason=(
        f"merged into the all-reduce of {m.kept} (all_reduce(a) + all_reduce(b) -> "
        f"all_reduce(a + b)); {removed} no longer runs; the merged site: {kept.path}"))
        for removed in m.removed]


def _is_training_graph() -> bool:
    """Whether this is the forward of a graph compiled for training (AOT autograd
    saw inputs that require grad): its norm intermediates are saved for backward."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return meta is not None and any(i.requires_grad for i in meta.input_info)


def _unfit(site: AllReduceSite, match: NormMatch, x: Optional[torch.Tensor],
           training: bool) -> Optional[str]:
    """Why this match cannot be replaced safely, or None."""
    if x is None or (match.weight is not None and val(match.weight) is None):
        return "no shape information on the graph"
    if not isinstance(x.shape[-1], int):
        return "hidden size is not static"
    layout_why = unfit_layout(x, val(match.residual) if match.residual is not None else None,
                              val(match.weight) if match.weight is not None else None)
    if layout_why is not None:
        return (f"{layout_why} ({', '.join(_strides(site, match))}): no fused kernel reads "
                "it in place, so the op would run the reference")
    if match.residual is not None:
        r = val(match.residual)
        seen = val(match.layout[-1]) if match.layout else x  # the sum as the add sees it
        if r is None or seen is None or r.dtype != x.dtype or r.shape != seen.shape:
            return "residual does not match the all-reduce input"
    replaced = match.nodes | set(site.nodes)
    for n in match.private | set(site.nodes) - {site.out}:
        outside = [u for u in n.users if u not in replaced]
        if outside:
            if training and any(u.op == "output" for u in outside):
                return (f"training graph (inputs require grad): {n.name} is saved for the "
                        "backward pass; the pass fuses inference graphs")
            return (f"{n.name} has users outside the pattern "
                    f"({', '.join(u.name for u in outside[:3])}): the fused op cannot serve them")
    return None


def _strides(site: AllReduceSite, match: NormMatch) -> list[str]:
    """The strides of the op's tensor inputs, by name, for a reason."""
    named = (("all-reduce input", site.inp), ("residual", match.residual), ("weight", match.weight))
    return [f"{name} {n.name} strides {tuple(val(n).stride())}" for name, n in named
            if isinstance(n, fx.Node) and val(n) is not None]


def _op_inputs(site: AllReduceSite, match: NormMatch) -> list[fx.Node]:
    nodes = [site.inp, match.weight, match.residual, *(getattr(match, s) for s in SCALARS),
             match.quant.scale if match.quant is not None else None]
    # The layout ops replayed on the input read their sizes (symbols under dynamic shapes).
    sizes = [a for n in match.layout for a in n.all_input_nodes
             if a not in match.layout and a not in site.nodes]
    return [n for n in nodes + sizes if isinstance(n, fx.Node)]


def _insertion_point(site: AllReduceSite, match: NormMatch) -> Optional[fx.Node]:
    """The node before which the fused op can go: after its inputs, before any
    user of its outputs."""
    nodes = list(site.out.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    first_use = min((order[u] for n in match.outputs for u in n.users if u not in match.nodes),
                    default=len(order))
    last_def = max(order[n] for n in _op_inputs(site, match))
    earliest = min(order[n] for n in set(site.nodes) | match.nodes)
    at = max(last_def + 1, earliest)
    if at > first_use:
        return None
    return nodes[at]


def _replace(graph: fx.Graph, site: AllReduceSite, match: NormMatch, path: gate.FusionPath,
             at: fx.Node) -> fx.Node:
    x = val(site.inp)
    replaced = match.nodes | set(site.nodes)
    y = match.y
    spec = match.spec(x.dtype, emit_y=y is not None and any(u not in replaced for u in y.users))
    with graph.inserting_before(at):
        # The op reduces the tensor in the shape the norm reads it (all-reduce is
        # elementwise); a weightless norm gets a weight of ones, exact in any dtype.
        x_in = layout.replay(graph, match.layout, site.inp)
        weight = match.weight if match.weight is not None else _ones(graph, x, match.weight_dtype)
    # Every argument by its name in op.ARGS; a scalar the spec holds as a literal has no node.
    given = {"x": x_in, "residual": match.residual, "weight": weight,
             **{s: getattr(match, s) if spec.takes(s) else None for s in SCALARS},
             "scale": match.quant.scale if match.quant is not None else None,
             "group_name": site.group_name, "path": path.value, "spec": spec.encode()}
    name = "allreduce_rmsnorm_quant" if spec.quant is not None else "allreduce_rmsnorm"
    target = getattr(torch.ops.fusion_pass, name).default
    names = OUTPUTS[:op.OPS[name]]
    args = tuple(given[n] for n, _ in op.ARGS if n in given)
    kwargs = {"site": ""}
    fake = _fake_outputs(target, args, kwargs)
    with graph.inserting_before(at):
        fused = graph.call_function(target, args, kwargs)
        outs = {name: graph.call_function(operator.getitem, (fused, i))
                for i, name in enumerate(names)}
    if fake is not None:
        fused.meta["val"] = fake
        for i, name in enumerate(names):
            outs[name].meta["val"] = fake[i]
    for node, name in match.outputs.items():
        node.replace_all_uses_with(outs[name], delete_user_cb=lambda u: u not in replaced)
    _erase_dead(replaced | set(outs.values()))
    return fused


def _ones(graph: fx.Graph, x: torch.Tensor, dtype: torch.dtype) -> fx.Node:
    hidden = x.shape[-1]
    node = graph.call_function(torch.ops.aten.full.default, ([hidden], 1.0),
                               {"dtype": dtype, "layout": torch.strided, "device": x.device,
                                "pin_memory": False})
    node.meta["val"] = x.new_ones((hidden,), dtype=dtype)
    return node


def _erase_dead(candidates: set[fx.Node]) -> None:
    """Erase the replaced nodes, unused outputs of the fused op, and what only they
    used (weight casts, ``1 + w``, an eps cast)."""
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


def _fake_outputs(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple]:
    from torch._guards import detect_fake_mode

    vals = [val(a) if isinstance(a, fx.Node) else a for a in args]
    kw = {k: val(v) if isinstance(v, fx.Node) else v for k, v in kwargs.items()}
    mode = detect_fake_mode([v for v in vals + list(kw.values()) if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return target(*vals, **kw)


def _tokens(x: Optional[torch.Tensor], rng: Optional[gate.TokenRange]) -> gate.Tokens:
    """The token count of ``x`` as far as the graph and the caller know it (None: unknown)."""
    if x is None or x.dim() < 1:
        return None
    n = gate.tokens_of(x.shape)
    if isinstance(n, int):
        return n
    if rng is not None:
        # vLLM's range compiles leave the symbol unbounded: the caller's range rules.
        return rng
    node = n.node
    bounds = node.shape_env.bound_sympy(node.expr)
    lo = int(bounds.lower) if isinstance(bounds.lower, sympy.Integer) else 1
    hi = int(bounds.upper) if isinstance(bounds.upper, sympy.Integer) else None
    return gate.TokenRange(max(lo, 0), hi)

"""What the pass decided, per compiled graph and per all-reduce site.

Every all-reduce the pass sees gets a :class:`SiteRecord`: fused (with its
path), fused by vLLM's in-tree pass, or left alone with the reason.  Records
are kept in memory (:data:`HISTORY`), logged (one summary per graph at INFO; the
first graph that leaves a site unfused says so once per process at WARNING),
and, when ``FUSION_PASS_RECORD_DIR`` names a directory, appended as JSON lines
to ``<dir>/fusion_pass_records.rank<r>.jsonl`` so that the demo, the CLI and
notebooks can read decisions made in other processes.

A graph loaded from a compile cache (Inductor's FX graph cache, vLLM's
compiled-artifact cache) never meets the pass.  Each fused op therefore
carries its site's record (:func:`site_tag`), and the op hands it here the
first time it runs that site (:func:`site_ran`), to be reported as part of a
graph record with ``source="cache"``.  A graph's identity is a digest of the
graph the pass was given and the token range, never a random id: the same
graph compiles to the same code.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from . import gate
from .log import logger

RECORD_DIR_ENV = "FUSION_PASS_RECORD_DIR"


class SitePath(str, enum.Enum):
    """What became of a site: a :class:`~fusion_pass.gate.FusionPath` the pass
    baked, or :attr:`VLLM_IN_TREE`, fused by vLLM's own all-reduce fusion pass."""

    ONE_STAGE = gate.FusionPath.ONE_STAGE.value
    TWO_STAGE = gate.FusionPath.TWO_STAGE.value
    RUNTIME = gate.FusionPath.RUNTIME.value
    UNFUSED = gate.FusionPath.UNFUSED.value
    VLLM_IN_TREE = "vllm_in_tree"

    def __str__(self) -> str:
        return self.value

    # Equal to its name as a string, and hashed as it: a record's path counts and
    # looks up under the name the JSON holds.
    __hash__ = str.__hash__


IN_TREE = SitePath.VLLM_IN_TREE


@dataclass
class SiteRecord:
    collective: str
    norm: Optional[str]
    hidden: Optional[int]
    dtype: Optional[str]
    world_size: int
    tokens: str
    path: SitePath
    reason: str
    backend: str
    group: str
    quant: Optional[str] = None
    """The FP8 mode fused into the op (``static``, ``per_token``, ``per_group``)."""
    out_dtype: Optional[str] = None
    """The dtype of the norm output where it differs from the activations'."""

    def __post_init__(self) -> None:
        self.path = SitePath(self.path)  # a record read back from JSON names it

    @property
    def fused(self) -> bool:
        return self.path is not SitePath.UNFUSED


def site_record(collective: str, x: Any, world_size: int, tokens: gate.Tokens,
                path: Any, reason: str, backend: str, group: str, norm: Optional[str] = None,
                quant: Optional[str] = None, out_dtype: Any = None) -> SiteRecord:
    """The record of one all-reduce, whatever became of it: ``x`` is the tensor it
    reduces (a graph's fake tensor, None where the graph has none), ``tokens`` what
    is known of its token count, ``path`` a :class:`SitePath` or its name,
    ``out_dtype`` the norm output's dtype where it differs from ``x``'s."""
    shaped = x is not None and x.dim() >= 1
    hidden = x.shape[-1] if shaped else None
    return SiteRecord(
        collective=collective, norm=norm, hidden=hidden if isinstance(hidden, int) else None,
        dtype=gate.dtype_name(x.dtype) if x is not None else None, world_size=world_size,
        tokens="unknown" if tokens is None else str(tokens), path=SitePath(path), reason=reason,
        backend=backend, group=group, quant=quant,
        out_dtype=gate.dtype_name(out_dtype) if out_dtype is not None else None)


@dataclass
class GraphRecord:
    graph: int
    rank: int
    token_range: str
    sites: list[SiteRecord] = field(default_factory=list)
    uuid: str = ""
    source: str = "pass"
    """``pass``: recorded while compiling; ``cache``: reported by the fused ops
    of a graph loaded from a compile cache (fused sites only)."""
    total: Optional[int] = None
    """For a cached graph: how many sites it had when it was compiled."""

    @property
    def fused(self) -> int:
        return sum(s.fused for s in self.sites)

    def summary(self) -> str:
        paths = Counter(s.path for s in self.sites)
        detail = ", ".join(f"{k} x{v}" for k, v in sorted(paths.items()))
        if self.source == "cache":
            return (f"fusion_pass: graph {self.graph} (rank {self.rank}, tokens {self.token_range}) "
                    f"loaded from a compile cache, where the pass does not run: its fused ops "
                    f"report {self.fused} fused site(s) of the {self.total} recorded when it was "
                    f"compiled ({detail})")
        return (f"fusion_pass: graph {self.graph} (rank {self.rank}, tokens {self.token_range}): "
                f"{len(self.sites)} all-reduce site(s), {self.fused} fused"
                + (f" ({detail})" if detail else ""))

    def to_json(self) -> dict:
        return asdict(self)


HISTORY: list[GraphRecord] = []

_warned = False
_compiled_here: set[str] = set()
ran: set[str] = set()
"""The site tags whose ops have run in this process (:func:`site_ran`): the op reads
it before calling, so that a site costs one set lookup per call after its first."""
_cached: dict[str, GraphRecord] = {}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _inputs(graph: Any) -> str:
    """The graph's inputs as the pass sees them (a graph's text names no dtype or shape)."""
    out = []
    for n in getattr(graph, "nodes", ()):
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        out.append(f"{n.name}:{getattr(v, 'dtype', type(v).__name__)}:"
                   f"{tuple(getattr(v, 'shape', ()))}:{getattr(v, 'device', '')}")
    return ";".join(out)


def new_graph_record(token_range: str, graph: Any = "") -> GraphRecord:
    """The record of a graph the pass is about to rewrite: ``graph`` (an FX graph,
    or its text) and ``token_range`` make its identity."""
    digest = hashlib.sha256(f"{token_range}\n{_inputs(graph)}\n{graph}".encode()).hexdigest()[:32]
    record = GraphRecord(graph=len(HISTORY), rank=_rank(), token_range=token_range, uuid=digest)
    _compiled_here.add(record.uuid)
    return record


def emit(record: GraphRecord) -> None:
    """Keep, log and (with ``FUSION_PASS_RECORD_DIR``) write a graph's record."""
    global _warned
    HISTORY.append(record)
    logger.log(logging.INFO if record.sites else logging.DEBUG, record.summary())
    left = [s for s in record.sites if not s.fused]
    for s in left:
        logger.info("fusion_pass:   left unfused (%s -> %s, hidden %s %s): %s",
                    s.collective, s.norm, s.hidden, s.dtype, s.reason)
    if left and not _warned:
        _warned = True
        reasons = Counter(s.reason for s in left)
        logger.warning(
            "fusion_pass: %d of %d all-reduce site(s) in graph %d left unfused: %s "
            "(said once per process; every decision: fusion_pass.records.HISTORY, "
            "FUSION_PASS_RECORD_DIR, fusion-pass inspect)", len(left), len(record.sites),
            record.graph, "; ".join(f"{r} (x{n})" for r, n in reasons.most_common()))
    _write(record)


def _write(record: GraphRecord) -> None:
    out_dir = os.environ.get(RECORD_DIR_ENV)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"fusion_pass_records.rank{record.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record.to_json()) + "\n")


def site_tag(record: GraphRecord, site: SiteRecord) -> str:
    """The ``site`` argument of a fused op: its record, its place in the graph (sites
    with equal records stay apart) and its graph's counts."""
    index = next(i for i, s in enumerate(record.sites) if s is site)
    return json.dumps({"g": record.uuid, "i": index, "r": record.token_range,
                       "n": len(record.sites), "s": asdict(site)}, sort_keys=True)


def site_of(tag: str) -> SiteRecord:
    """The site record a :func:`site_tag` carries."""
    return SiteRecord(**json.loads(tag)["s"])


def site_ran(tag: str) -> None:
    """Called by the fused op on the first call of each site: a site whose graph
    was not compiled in this process is reported (a compile-cache hit)."""
    if tag in ran:
        return
    ran.add(tag)
    d = json.loads(tag)
    if d["g"] in _compiled_here:
        return
    record = _cached.get(d["g"])
    if record is None:
        record = GraphRecord(graph=len(HISTORY), rank=_rank(), token_range=d["r"], uuid=d["g"],
                             source="cache", total=d["n"])
        _cached[d["g"]] = record
        HISTORY.append(record)
    site = SiteRecord(**d["s"])
    record.sites.append(site)
    logger.info("%s", record.summary())
    _write(GraphRecord(graph=record.graph, rank=record.rank, token_range=record.token_range,
                       sites=[site], uuid=record.uuid, source="cache", total=record.total))


def read_dir(path: str) -> list[GraphRecord]:
    """Every record written under ``path`` (recursively), in file order; the lines
    a cached graph's ops wrote one site at a time are merged into one record."""
    out: list[GraphRecord] = []
    cached: dict[tuple[int, str], GraphRecord] = {}
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if name.startswith("fusion_pass_records.") and name.endswith(".jsonl"):
                with open(os.path.join(root, name)) as f:
                    for line in f:
                        d = json.loads(line)
                        sites = [SiteRecord(**s) for s in d.pop("sites")]
                        rec = GraphRecord(sites=sites, **d)
                        key = (rec.rank, rec.uuid)
                        if rec.source == "cache" and key in cached:
                            cached[key].sites.extend(rec.sites)
                            continue
                        if rec.source == "cache":
                            cached[key] = rec
                        out.append(rec)
    return out

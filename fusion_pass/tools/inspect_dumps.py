"""``fusion-pass inspect DIR``: what the pass saw and did, read back from a graph dump.

A dump directory is what depyf writes (``depyf.prepare_debug(dir)`` around a
``torch.compile``, or vLLM's ``debug_dump_path`` with one ``rank_{r}_dp_{d}/``
per worker), optionally with the pass's own decision records
(``fusion_pass_records.rank<r>.jsonl``, written when ``FUSION_PASS_RECORD_DIR``
names the directory).  depyf names its files
``__compiled_fn_<N>.<stage>.<k>.py``; the stages read here are:

* ``Forward_graph`` (AOT autograd's graph, handed to Inductor) or, in vLLM
  dumps, ``post_grad.<i>.<Pass>.before`` of our pass: the graph *before* the
  pass, whose all-reduces are the sites the pass recorded, one each, in order;
* ``AFTER_POST_GRAD``: the graph after every post-grad pass, ours included,
  where the fused ``torch.ops.fusion_pass.allreduce_rmsnorm`` calls carry their
  baked path;
* ``kernel_<k>``: Inductor's output code (the modules with a ``call``
  function), where the fused calls must survive lowering.

Graphs are parsed with :mod:`ast`, never executed.  What a site is, and what
became of it, is the pass's own record, never guessed from the text: records are
paired with the post-grad graphs of the same rank by what they fused (path,
hidden size, dtype, token count), in compile order, because depyf writes a graph
identical to an earlier one only once, so the two lists need not have equal
lengths; within a graph, the record's sites with the graph's all-reduces in
order.  A fused call's arguments are read by the op's own argument table and
its spec decoded by :class:`~fusion_pass.spec.NormSpec`.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .. import records as _records
from ..spec import NormSpec

FUSED_OP = "torch.ops.fusion_pass.allreduce_rmsnorm.default"
FUSED_QUANT_OP = "torch.ops.fusion_pass.allreduce_rmsnorm_quant.default"
FUSED_OPS = (FUSED_OP, FUSED_QUANT_OP)

_GRAPH_FILE = re.compile(r"^(__compiled_fn_\d+)\.(.+)\.(\d+)\.py$")
_KERNEL_FILE = re.compile(r"^(__compiled_fn_\d+)\.kernel_(\d+)\.py$")
_DEPYF_FILE = re.compile(r"^(__compiled_fn_\d+\..+\.py|__transformed_code_.+\.py|full_code_for_.+\.py)$")
_RANK_DIR = re.compile(r"^rank_(\d+)_dp_(\d+)$")
# The vLLM plugin's per-process depyf dirs are named by process; vLLM names its
# tensor-parallel workers "VllmWorker-<rank>" (one node, no data parallelism).
_WORKER_DIR = re.compile(r"^VllmWorker-(\d+)-pid\d+$")
_RECORD_FILE = re.compile(r"^fusion_pass_records\.rank(\d+)\.jsonl$")
_OUR_PASS = re.compile(r"fusion_?pass|allreduce_?rms_?norm_?fusion", re.I)
# The collectives the pass records a site for: c10d's and vLLM's all_reduce, vLLM
# CPU's shm_allreduce (c10d's wait_tensor is not one of them).
_ALL_REDUCE = re.compile(r"all_?reduce", re.I)

_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
           "i8": "int8", "i32": "int32", "i64": "int64", "b8": "bool",
           "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}
_TYPE = re.compile(r"^([a-z0-9]+)\[(.*)\]$")


class InspectError(Exception):
    """A directory that cannot be inspected; the message is one line for the user."""


# --------------------------------------------------------------------------- graphs


@dataclass
class Node:
    name: str
    target: str
    args: list[Any]
    """Positional arguments: node names as ``Ref``, constants as themselves."""
    type: Optional[str]
    line: int
    source: Optional[str]
    """The ``# File: ... code: ...`` comment Dynamo put above the node."""
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ref:
    name: str


def _dotted(expr: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def _arg(expr: ast.AST) -> Any:
    if isinstance(expr, ast.Name):
        return Ref(expr.id)
    if isinstance(expr, (ast.List, ast.Tuple)):
        return [_arg(e) for e in expr.elts]
    if (isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub)
            and isinstance(expr.operand, ast.Constant)
            and isinstance(expr.operand.value, (int, float))):
        return -expr.operand.value
    if isinstance(expr, ast.Constant):
        return expr.value
    return _dotted(expr) or ast.unparse(expr)


def _refs(args: list[Any]) -> list[str]:
    out = []
    for a in args:
        if isinstance(a, Ref):
            out.append(a.name)
        elif isinstance(a, list):
            out.extend(_refs(a))
    return out


def _source_comments(lines: list[str]) -> dict[int, str]:
    """Line number -> the most recent ``# File:`` comment at or above it."""
    out, current = {}, None
    for i, line in enumerate(lines, 1):
        s = line.strip()
        if s.startswith("# File:") or s.startswith("# No stacktrace"):
            current = s[2:] if s.startswith("# File:") else None
        out[i] = current
    return out


def parse_graph(path: str) -> list[Node]:
    """The call nodes of a dumped FX graph module (``forward`` of its class)."""
    text = _read(path)
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise InspectError(f"{path}: not a parsable graph dump ({e.msg}, line {e.lineno})") from None
    fwd = next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
    if fwd is None:
        return []
    comments = _source_comments(text.splitlines())
    # Graph inputs carry types too: in vLLM's piecewise graphs the all-reduce input often is one.
    nodes = [Node(a.arg, "placeholder", [], a.annotation.value, fwd.lineno, None)
             for a in fwd.args.args if isinstance(a.annotation, ast.Constant)]
    for stmt in fwd.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name, value = stmt.target.id, stmt.value
            typ = stmt.annotation.value if isinstance(stmt.annotation, ast.Constant) else None
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value, typ = stmt.targets[0].id, stmt.value, None
        else:
            continue
        kwargs: dict[str, Any] = {}
        if isinstance(value, ast.Call):
            target = _dotted(value.func) or ast.unparse(value.func)
            kwargs = {k.arg: _arg(k.value) for k in value.keywords if k.arg}
            args = [_arg(a) for a in value.args] + [_arg(k.value) for k in value.keywords]
            # auto_functionalized(op, ...): the op is what the node does.
            if target.endswith("auto_functionalized") and args and isinstance(args[0], str):
                target = args[0]
        elif isinstance(value, ast.Subscript):
            target, args = "getitem", [_arg(value.value)]
        elif isinstance(value, ast.BinOp):
            target, args = type(value.op).__name__.lower(), [_arg(value.left), _arg(value.right)]
        else:
            continue
        nodes.append(Node(name, target, args, typ, stmt.lineno, comments.get(stmt.lineno), kwargs))
    return nodes


def parse_type(annotation: Optional[str]) -> tuple[Optional[str], Optional[list[str]]]:
    """``"bf16[s22, 4096]"`` -> (``"bfloat16"``, ``["s22", "4096"]``)."""
    m = _TYPE.match(annotation or "")
    if m is None:
        return None, None
    dims = [d.strip() for d in m.group(2).split(",") if d.strip()]
    return _DTYPES.get(m.group(1), m.group(1)), dims


def _shape_info(annotation: Optional[str]) -> dict[str, Any]:
    dtype, dims = parse_type(annotation)
    hidden = int(dims[-1]) if dims and dims[-1].isdigit() else None
    tokens = math.prod(int(d) for d in dims[:-1]) if dims and all(d.isdigit() for d in dims[:-1]) else None
    return {"type": annotation, "dtype": dtype, "hidden": hidden, "tokens": tokens}


def _short(source: Optional[str]) -> Optional[str]:
    """``File: /a/b/model.py:20 in forward, code: ...`` -> ``model.py:20``."""
    if not source:
        return None
    m = re.match(r"File: (\S+?):(\d+) in (\S+), code: (.*)", source)
    if m is None:
        return source
    return f"{os.path.basename(m.group(1))}:{m.group(2)} ({m.group(4).strip()})"


def find_all_reduces(nodes: list[Node]) -> list[dict[str, Any]]:
    """The all-reduces of a graph before the pass, in graph order: each is a site the
    pass recorded (:func:`pair_records` attaches what became of it)."""
    users: dict[str, list[Node]] = {}
    for n in nodes:
        for r in _refs(n.args):
            users.setdefault(r, []).append(n)
    sites = []
    for n in nodes:
        if not _ALL_REDUCE.search(n.target) or "fusion_pass" in n.target:
            continue
        value = n if n.type else next((u for u in users.get(n.name, []) if u.type), n)
        sites.append({"all_reduce": n.name, "collective": _op_name(n.target), "line": n.line,
                      "source": _short(n.source), "record": None, **_shape_info(value.type)})
    return sites


def _op_name(target: str) -> str:
    return target.removeprefix("torch.ops.").removesuffix(".default")


def _name(v: Any) -> Any:
    return v.name if isinstance(v, Ref) else v


def site_record(tag: Any) -> Optional[_records.SiteRecord]:
    """The pass's record of the site a fused call replaced (its ``site`` argument)."""
    return _records.site_of(tag) if isinstance(tag, str) and tag else None


def find_fused(nodes: list[Node]) -> list[dict[str, Any]]:
    """The fused op calls of a post-grad graph, with their baked arguments."""
    types = {n.name: n.type for n in nodes}
    out = []
    for n in nodes:
        if n.target not in FUSED_OPS:
            continue
        args = bind(n.args[:len(n.args) - len(n.kwargs)], n.kwargs)
        x = args.get("x")
        spec = NormSpec.decode(args["spec"])
        site = site_record(args.get("site"))

        def scalar(name: str) -> Any:
            return _name(args.get(name)) if spec.takes(name) else getattr(spec, name)

        out.append({"node": n.name, "path": args.get("path"), "eps": scalar("eps"),
                    "multiplier": scalar("multiplier"), "group": args.get("group_name"),
                    "gemma": spec.gemma, "x": _name(x), "residual": _name(args.get("residual")),
                    "weight": args["weight"].name if isinstance(args.get("weight"), Ref) else None,
                    "quant": spec.quant.mode if spec.quant is not None else None,
                    "out_dtype": spec.out_dtype,
                    "reason": site.reason if site is not None else None,
                    "line": n.line,
                    **_shape_info(types.get(x.name) if isinstance(x, Ref) else None)})
    return out


def bind(args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A fused call's arguments by the op's names (:data:`fusion_pass.op.ARGS`)."""
    from .. import op

    return op.arguments(args, kwargs)


def fused_calls_in_code(path: str) -> Optional[list[str]]:
    """Baked paths of the fused calls in an Inductor output-code module, or None
    when the file is not an output-code module (a kernel module)."""
    try:
        tree = ast.parse(_read(path))
    except SyntaxError:
        return None
    if not any(isinstance(f, ast.FunctionDef) and f.name == "call" for f in ast.walk(tree)):
        return None
    paths = []
    for c in ast.walk(tree):
        target = _dotted(c.func) if isinstance(c, ast.Call) else None
        if target in FUSED_OPS:
            assert isinstance(c, ast.Call)
            a = bind(list(c.args), {k.arg: k.value for k in c.keywords if k.arg})["path"]
            paths.append(a.value if isinstance(a, ast.Constant) else "?")
    return paths


# --------------------------------------------------------------------------- result


@dataclass
class CompiledGraph:
    """One Inductor compile: one run of the post-grad passes, ours included."""

    fn: Optional[str]
    index: Optional[int]
    before_file: Optional[str] = None
    after_file: Optional[str] = None
    output_code_file: Optional[str] = None
    sites_before: list[dict[str, Any]] = field(default_factory=list)
    fused: list[dict[str, Any]] = field(default_factory=list)
    output_code_paths: Optional[list[str]] = None
    record: Optional[dict[str, Any]] = None
    """The pass's record for this compile: graph number, token range, every site's decision."""

    @property
    def name(self) -> str:
        return f"{self.fn}#{self.index}" if self.fn else f"record {self.record['graph']}"

    @property
    def decisions(self) -> list[dict[str, Any]]:
        return self.record["sites"] if self.record else []

    @property
    def unfused(self) -> list[dict[str, Any]]:
        return [s for s in self.decisions if s["path"] == "unfused"]

    @property
    def in_tree(self) -> list[dict[str, Any]]:
        """Sites vLLM's in-tree all-reduce fusion fused before our pass ran."""
        return [s for s in self.decisions if s["path"] == _records.IN_TREE]


@dataclass
class RankDump:
    rank: Optional[int]
    dp: Optional[int]
    dir: Optional[str]
    """Relative to the dump root; None when only records exist for this rank."""
    transformed_code: list[str] = field(default_factory=list)
    graphs: list[CompiledGraph] = field(default_factory=list)

    @property
    def label(self) -> str:
        r = "?" if self.rank is None else str(self.rank)
        return f"rank {r}" + (f" dp {self.dp}" if self.dp is not None else "")


@dataclass
class DumpReport:
    root: str
    ranks: list[RankDump]
    warnings: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        graphs = [g for r in self.ranks for g in r.graphs]
        return {"ranks": len(self.ranks), "graphs": len(graphs),
                "sites_before": sum(len(g.sites_before) for g in graphs),
                "fused": sum(len(g.fused) for g in graphs),
                "recorded_sites": sum(len(g.decisions) for g in graphs),
                "unfused": sum(len(g.unfused) for g in graphs),
                "in_tree": sum(len(g.in_tree) for g in graphs),
                "from_cache": sum(1 for g in graphs if g.record and g.record.get("source") == "cache")}

    def decision_table(self) -> list[dict[str, Any]]:
        """One row per recorded site: the pass's decision and why."""
        return [{"rank": r.rank, "graph": g.name, "token_range": g.record["token_range"], **s}
                for r in self.ranks for g in r.graphs if g.record for s in g.record["sites"]]

    def to_json(self) -> dict[str, Any]:
        def graph(g: CompiledGraph) -> dict[str, Any]:
            d = asdict(g)
            d["unfused"] = g.unfused
            d["in_tree"] = g.in_tree
            return d

        return {"root": self.root, "totals": self.totals(), "warnings": self.warnings,
                "ranks": [{"rank": r.rank, "dp": r.dp, "dir": r.dir,
                           "transformed_code": r.transformed_code,
                           "graphs": [graph(g) for g in r.graphs]} for r in self.ranks]}

    def format(self) -> str:
        t = self.totals()
        lines = [f"{self.root}: {t['ranks']} rank(s), {t['graphs']} compiled graph(s), "
                 f"{t['sites_before']} all-reduce site(s) before the pass, "
                 f"{t['fused']} fused op(s) after it, {t['unfused']} left unfused"
                 + (f", {t['in_tree']} fused by vLLM's in-tree pass" if t["in_tree"] else "")
                 + (f"; {t['from_cache']} graph(s) loaded from a compile cache" if t["from_cache"] else "")]
        for r in self.ranks:
            lines.append(f"{r.label}" + (f" ({r.dir or '.'}/)" if r.dir is not None else " (records only)"))
            for g in r.graphs:
                lines.extend("  " + s for s in _format_graph(g))
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def _format_graph(g: CompiledGraph) -> list[str]:
    head = f"graph {g.name}"
    if g.record and g.record.get("source") == "cache":
        head += (f" (loaded from a compile cache: the pass did not run; its fused ops reported "
                 f"{len(g.decisions)} of the {g.record.get('total')} site(s) recorded at compile "
                 f"time, tokens {g.record['token_range']})")
    elif g.record:
        head += f" (pass record {g.record['graph']}, tokens {g.record['token_range']})"
    elif g.after_file:
        head += " (no pass record)"
    out = [head]
    if g.before_file:
        out.append(f"  before the pass ({g.before_file}): {len(g.sites_before)} site(s)")
        for s in g.sites_before:
            where = f"  at {s['source']}" if s["source"] else ""
            rec = s["record"]
            became = f" -> {rec['norm']}: {rec['path']}" if rec is not None else ""
            out.append(f"    {s['all_reduce']} [{s['collective']}]{became}"
                       f"  {s['type'] or ''}{where}")
    if g.after_file:
        out.append(f"  after the pass ({g.after_file}): {len(g.fused)} fused op(s)")
        for f in g.fused:
            res = f"residual={f['residual']}" if f["residual"] is not None else "no residual"
            out.append(f"    {f['node']}: path={f['path']}  x={f['x']} {f['type'] or ''}  {res}"
                       f"  eps={f['eps']}  group={f['group']!r}" + ("  gemma" if f["gemma"] else "")
                       + (f"  times {f['multiplier']}" if f["multiplier"] is not None else "")
                       + (f"  + fp8 {f['quant']}" if f["quant"] else "")
                       + (f"  y in {f['out_dtype']}" if f["out_dtype"] else ""))
    if g.output_code_paths is not None:
        out.append(f"  output code ({g.output_code_file}): {len(g.output_code_paths)} fused call(s)"
                   + (f": {_count(g.output_code_paths)}" if g.output_code_paths else ""))
    if g.record and not g.after_file:
        for s in g.decisions:
            if s["path"] not in ("unfused", _records.IN_TREE):
                quant = f" + fp8 {s['quant']}" if s.get("quant") else ""
                out.append(f"  fused ({s['path']}): {s['collective']} -> {s['norm']}{quant}, "
                           f"hidden {s['hidden']} {s['dtype']}, tokens {s['tokens']}")
    for s in g.in_tree:
        out.append(f"  fused by vLLM's in-tree pass: {s['norm']} (hidden {s['hidden']} "
                   f"{s['dtype']}): {s['reason']}")
    for s in g.unfused:
        out.append(f"  left unfused: {s['collective']} -> {s['norm']} (hidden {s['hidden']} "
                   f"{s['dtype']}, tokens {s['tokens']}): {s['reason']}")
    return out


def _count(paths: list[str]) -> str:
    c: dict[str, int] = {}
    for p in paths:
        c[p] = c.get(p, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items()))


# --------------------------------------------------------------------------- reading


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _depyf_dirs(root: str) -> list[str]:
    out = []
    for d, subdirs, files in os.walk(root):
        subdirs.sort()
        if any(_DEPYF_FILE.match(f) for f in files):
            out.append(d)
    return out


def _rank_of(root: str, d: str) -> tuple[Optional[int], Optional[int]]:
    for part in reversed(os.path.relpath(d, root).split(os.sep)):
        m = _RANK_DIR.match(part)
        if m:
            return int(m.group(1)), int(m.group(2))
        m = _WORKER_DIR.match(part)
        if m:
            return int(m.group(1)), 0
    return None, None


def _graphs_in(root: str, d: str) -> list[CompiledGraph]:
    files = sorted(os.listdir(d))
    stages: dict[tuple[str, str], dict[int, str]] = {}
    kernels: dict[str, list[tuple[int, str]]] = {}
    for f in files:
        m = _KERNEL_FILE.match(f)
        if m:
            kernels.setdefault(m.group(1), []).append((int(m.group(2)), f))
            continue
        m = _GRAPH_FILE.match(f)
        if m:
            stages.setdefault((m.group(1), m.group(2)), {})[int(m.group(3))] = f
    fns = sorted({fn for fn, _ in stages}, key=lambda s: int(s.rsplit("_", 1)[1]))
    rel = lambda f: os.path.relpath(os.path.join(d, f), root)  # noqa: E731
    graphs = []
    for fn in fns:
        afters = stages.get((fn, "AFTER_POST_GRAD"), {})
        befores = _before_files(stages, fn)
        codes = [(f, p) for _, f in sorted(kernels.get(fn, []))
                 if (p := fused_calls_in_code(os.path.join(d, f))) is not None]
        for k in sorted(afters):
            g = CompiledGraph(fn=fn, index=k, after_file=rel(afters[k]))
            g.fused = find_fused(parse_graph(os.path.join(d, afters[k])))
            if k in befores:
                g.before_file = rel(befores[k])
                g.sites_before = find_all_reduces(parse_graph(os.path.join(d, befores[k])))
            # Output-code modules pair with post-grad graphs only when depyf
            # wrote one of each; otherwise which is which cannot be told.
            if len(codes) == len(afters):
                g.output_code_file, g.output_code_paths = rel(codes[k][0]), codes[k][1]
            graphs.append(g)
    return graphs


def _before_files(stages: dict[tuple[str, str], dict[int, str]], fn: str) -> dict[int, str]:
    """Per compile index, the dumped graph right before our pass."""
    ours = sorted(s for f, s in stages if f == fn and s.startswith("post_grad")
                  and s.endswith(".before") and _OUR_PASS.search(s))
    if ours:
        return stages[(fn, ours[-1])]
    # AOT autograd's graphs in the order Inductor compiles them.
    ordered = [stages[(fn, s)][k] for s in ("Forward_graph", "Backward_graph")
               for k in sorted(stages.get((fn, s), {}))]
    return dict(enumerate(ordered))


def _read_records(root: str) -> list[_records.GraphRecord]:
    try:
        return _records.read_dir(root)
    except (ValueError, TypeError, KeyError) as e:
        raise InspectError(f"{root}: unreadable fusion_pass record file ({type(e).__name__}: {e})") from None


def _record_signature(rec: dict[str, Any]) -> tuple:
    return tuple((s["path"], s["hidden"], s["dtype"], int(s["tokens"]) if s["tokens"].isdigit() else None)
                 for s in rec["sites"] if s["path"] not in ("unfused", _records.IN_TREE))


def _graph_signature(g: CompiledGraph) -> tuple:
    return tuple((f["path"], f["hidden"], f["dtype"], f["tokens"]) for f in g.fused)


def _attach_records(rank: RankDump, recs: list[dict[str, Any]], warnings: list[str]) -> None:
    """Pair records with post-grad graphs in order, by what they fused."""
    if any(b["graph"] <= a["graph"] for a, b in zip(recs, recs[1:])):
        start = max(i for i, (a, b) in enumerate(zip(recs, recs[1:]), 1) if b["graph"] <= a["graph"])
        warnings.append(f"{rank.label}: the record file holds several runs; showing the last "
                        f"({len(recs) - start} of {len(recs)} records)")
        recs = recs[start:]
    pos, unmatched = 0, []
    for g in rank.graphs:
        sig = _graph_signature(g)
        j = next((j for j in range(pos, len(recs)) if _record_signature(recs[j]) == sig), None)
        if j is None:
            continue
        unmatched.extend(recs[pos:j])
        g.record, pos = recs[j], j + 1
        if len(recs[j]["sites"]) == len(g.sites_before):  # one record per all-reduce, in order
            for s, rec in zip(g.sites_before, recs[j]["sites"]):
                s["record"] = rec
    unmatched.extend(recs[pos:])
    if unmatched and rank.graphs:
        warnings.append(f"{rank.label}: {len(unmatched)} pass record(s) match no dumped post-grad "
                        "graph (depyf writes identical graphs once; a cache hit dumps none); "
                        "listed as record-only graphs")
    rank.graphs.extend(CompiledGraph(fn=None, index=None, record=r) for r in unmatched)


def inspect_dir(path: str) -> DumpReport:
    """Read a dump directory; raises :class:`InspectError` when it is not one."""
    root = os.path.abspath(path)
    if not os.path.exists(root):
        raise InspectError(f"{path}: no such directory")
    if not os.path.isdir(root):
        raise InspectError(f"{path}: not a directory")
    if not any(files for _, _, files in os.walk(root)):
        raise InspectError(f"{path}: the directory is empty (was anything compiled under depyf?)")
    dirs = _depyf_dirs(root)
    recs = _read_records(root)
    if not dirs and not recs:
        raise InspectError(f"{path}: not a graph dump (no depyf __compiled_fn_*/__transformed_code_* "
                           "files and no fusion_pass_records.*.jsonl)")
    ranks = []
    for d in dirs:
        rank, dp = _rank_of(root, d)
        rel = os.path.relpath(d, root)
        ranks.append(RankDump(rank=rank, dp=dp, dir=rel,
                              transformed_code=sorted(f for f in os.listdir(d) if f.startswith("__transformed_code_")),
                              graphs=_graphs_in(root, d)))
    warnings: list[str] = []
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_rank.setdefault(r.rank, []).append(r.to_json())
    for r, rs in sorted(by_rank.items()):
        owners = [d for d in ranks if d.rank == r]
        if not owners and len(ranks) == 1 and ranks[0].rank is None and len(by_rank) == 1:
            owners = ranks  # a plain depyf dir of a single process
        if len(owners) > 1:
            warnings.append(f"rank {r}: records cannot be told apart between "
                            f"{[o.dir for o in owners]} (several dp ranks); not attached")
            continue
        if not owners:
            owners = [RankDump(rank=r, dp=None, dir=None)]
            ranks.append(owners[0])
        _attach_records(owners[0], rs, warnings)
    ranks.sort(key=lambda x: (x.rank is None, x.rank or 0, x.dp or 0))
    return DumpReport(root=root, ranks=ranks, warnings=warnings)


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fusion-pass inspect",
        description="Summarise a depyf / vLLM graph dump: all-reduce -> RMSNorm sites before "
                    "the fusion pass, fused ops after it, and what was left unfused and why.")
    parser.add_argument("dir", help="dump directory (depyf.prepare_debug dir, vLLM debug_dump_path, "
                                    "or the demo's dump dir)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = inspect_dir(ns.dir)
    except InspectError as e:
        print(f"fusion-pass inspect: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fusion-pass inspect: error: {ns.dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:  # a dump we do not understand: one line, never a traceback
        print(f"fusion-pass inspect: error: {ns.dir}: cannot read this dump "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    try:
        print(json.dumps(report.to_json(), indent=2) if ns.json else report.format())
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")
    return 0

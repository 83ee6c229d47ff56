"""Plotting and reading helpers shared by the notebooks in this folder.

Kept out of the notebooks so that they stay short and so that the tests can
exercise the benchmark reader on every schema it accepts.
"""

from __future__ import annotations

import html
import json
import os
import re
from typing import Any, Iterable, Optional

PATH_COLORS = {"one_stage": "#2a9d8f", "two_stage": "#e9c46a", "runtime": "#8ab17d",
               "unfused": "#bc4749"}
PATH_ORDER = ("one_stage", "two_stage", "runtime", "unfused")


def figure_dir() -> str:
    """Where notebooks save their key figures: ``docs/img/`` of the repository, or
    ``$FUSION_PASS_FIGURE_DIR`` (the tests point it elsewhere)."""
    d = os.environ.get("FUSION_PASS_FIGURE_DIR") or os.path.join(os.path.dirname(__file__), "..", "docs", "img")
    os.makedirs(d, exist_ok=True)
    return os.path.abspath(d)


# --------------------------------------------------------------------------- graphs


def graph_window(path: str, first: int, last: int, context: int = 2) -> str:
    """Lines ``first..last`` (1-based) of a dumped graph, with ``context`` around,
    without Dynamo's long ``# File:`` comments and the ``x = None`` clean-ups."""
    with open(path) as f:
        lines = f.read().splitlines()
    out = []
    for line in lines[max(first - 1 - context, 0):last + context]:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        out.append(re.sub(r";\s+(\w+ = )+None$", "", s))
    return "\n".join(out)


def side_by_side(left: str, right: str, titles: tuple[str, str] = ("before", "after")) -> str:
    """HTML with two code columns."""
    cell = ('<td style="vertical-align:top; text-align:left"><b>{}</b>'
            '<pre style="font-size:11px; white-space:pre-wrap">{}</pre></td>')
    return ("<table><tr>" + cell.format(html.escape(titles[0]), html.escape(left))
            + cell.format(html.escape(titles[1]), html.escape(right)) + "</tr></table>")


def side_by_side_figure(left: str, right: str, titles: tuple[str, str], path: str) -> None:
    """The same two columns as a PNG, for the README."""
    import matplotlib.pyplot as plt

    wrap = lambda t: "\n".join(l if len(l) <= 150 else l[:147] + "..." for l in t.splitlines())  # noqa: E731
    left, right = wrap(left), wrap(right)
    n = max(left.count("\n"), right.count("\n")) + 2
    fig, axes = plt.subplots(1, 2, figsize=(22, 0.19 * n + 0.8))
    for ax, text, title in zip(axes, (left, right), titles):
        ax.axis("off")
        ax.set_title(title, loc="left", fontsize=10, fontweight="bold")
        ax.text(0, 1, text, family="monospace", fontsize=6.5, va="top", ha="left",
                transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- gate


def path_heatmap(ax: Any, rows: list[dict[str, Any]], labels: list[str], tokens: list[int],
                 title: str, label_key: str = "model") -> None:
    """Models (rows) x token counts (columns), coloured by the path the gate takes."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    index = {p: i for i, p in enumerate(PATH_ORDER)}
    grid = np.full((len(labels), len(tokens)), np.nan)
    pos_l = {m: i for i, m in enumerate(labels)}
    pos_t = {t: j for j, t in enumerate(tokens)}
    for r in rows:
        if r[label_key] in pos_l and r["tokens"] in pos_t:
            grid[pos_l[r[label_key]], pos_t[r["tokens"]]] = index[r["path"]]
    cmap = ListedColormap([PATH_COLORS[p] for p in PATH_ORDER])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(PATH_ORDER) - 0.5, aspect="auto")
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens], rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("tokens")
    ax.set_title(title, fontsize=9)


def path_legend(fig: Any) -> None:
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=PATH_COLORS[p], label=p) for p in PATH_ORDER],
               loc="upper center", ncol=len(PATH_ORDER), frameon=False)


# --------------------------------------------------------------------------- benchmarks

# Accepted spellings of each field, first match wins.
_FIELDS = {
    "impl": ("impl", "implementation", "variant", "method", "backend", "name", "kernel"),
    "hidden": ("hidden", "hidden_size", "dim"),
    "tokens": ("tokens", "num_tokens", "n_tokens", "ntokens", "m"),
    "us": ("us", "latency_us", "time_us", "median_us", "mean_us", "p50_us"),
    "ms": ("ms", "latency_ms", "time_ms", "median_ms", "mean_ms"),
    "dtype": ("dtype",),
    "world_size": ("world_size", "ws", "tp", "world"),
    "quant": ("quant",),
}
_LIST_KEYS = ("results", "records", "rows", "data", "measurements", "entries")
_META_KEYS = ("meta", "metadata", "config", "setup")
BASELINE = re.compile(r"unfused|baseline|nccl|reference|eager", re.I)
# Measured for scale, not implementations of the op: no ratio for them.
NOT_AN_IMPL = re.compile(r"barrier", re.I)


def _pick(d: dict[str, Any], field: str) -> Any:
    for k in _FIELDS[field]:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _normalise(d: dict[str, Any], source: str, inherited: dict[str, Any]) -> Optional[dict[str, Any]]:
    d = {**inherited, **d}
    us = _pick(d, "us")
    if us is None and _pick(d, "ms") is not None:
        us = float(_pick(d, "ms")) * 1000.0
    row = {"impl": _pick(d, "impl"), "hidden": _pick(d, "hidden"), "tokens": _pick(d, "tokens"),
           "us": us, "dtype": _pick(d, "dtype"), "world_size": _pick(d, "world_size"),
           "quant": _pick(d, "quant"), "source": source}
    try:
        row["hidden"], row["tokens"], row["us"] = int(row["hidden"]), int(row["tokens"]), float(row["us"])
    except (TypeError, ValueError):
        return None
    if row["impl"] is None:
        return None
    row["impl"] = str(row["impl"])
    return row


def _wide(d: dict[str, Any], source: str, inherited: dict[str, Any]) -> list[dict[str, Any]]:
    """A "wide" record, ``{"hidden": 4096, "tokens": 8, "nccl": 10.9, "fused": 3.6}``: every
    other numeric field but ``*_vs_*`` ratios is one implementation's latency (us; ms when
    named ``*_ms``); a
    ``quant`` field (the FP8 op benchmark's mode) goes with each of them."""
    if _pick(d, "hidden") is None or _pick(d, "tokens") is None or _pick(d, "impl") is not None:
        return []
    known = {k for names in _FIELDS.values() for k in names}
    rows = []
    for k, v in d.items():
        if k in known or "_vs_" in k or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # "a_vs_b": a ratio the benchmark computed, not a latency
        us = {"us": v * 1000.0} if k.endswith("_ms") else {"us": v}
        row = _normalise({"hidden": _pick(d, "hidden"), "tokens": _pick(d, "tokens"), "impl": k,
                          "quant": _pick(d, "quant"), **us},
                         source, {k2: v2 for k2, v2 in inherited.items() if k2 in ("dtype", "world_size")})
        if row is not None:
            rows.append(row)
    return rows


def _walk(obj: Any, source: str, inherited: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """Every record in ``obj``: a list of records, a dict holding such a list,
    or dicts keyed by implementation (``{"triton": [...]}``) at any depth."""
    if isinstance(obj, list):
        for item in obj:
            _walk(item, source, inherited, out)
        return
    if not isinstance(obj, dict):
        return
    row = _normalise(obj, source, inherited)
    if row is not None:
        out.append(row)
        return
    wide = _wide(obj, source, inherited)
    if wide:
        out.extend(wide)
        return
    scalars = {k: v for k, v in obj.items() if not isinstance(v, (dict, list))}
    for key in _META_KEYS:
        if isinstance(obj.get(key), dict):
            scalars.update({k: v for k, v in obj[key].items() if not isinstance(v, (dict, list))})
    context = {**inherited, **scalars}
    for key in _LIST_KEYS:
        if isinstance(obj.get(key), list):
            _walk(obj[key], source, context, out)
            return
    for k, v in obj.items():
        if isinstance(v, (dict, list)):
            # A dict keyed by implementation names the impl only by its key.
            sub = context if _pick(context, "impl") is not None else {**context, "impl": k}
            _walk(v, source, sub, out)


def _model_rows(obj: Any, source: str) -> list[dict[str, Any]]:
    """``bench_model.py``'s schema: ``models[].shapes[]`` with fused / unfused step medians."""
    if not isinstance(obj, dict) or not isinstance(obj.get("models"), list):
        return []
    meta = obj.get("meta") or {}
    return [{"impl": impl, "hidden": int(m["hidden"]), "tokens": int(s["tokens"]),
             "us": float(s[impl]["median_us"]), "dtype": meta.get("dtype"),
             "world_size": meta.get("world_size"), "quant": m.get("quant"), "source": source}
            for m in obj["models"] for s in m.get("shapes", []) for impl in ("fused", "unfused")
            if isinstance(s.get(impl), dict) and "median_us" in s[impl]]


def load_benchmarks(results_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Normalised rows ``impl, hidden, tokens, us, dtype, world_size, quant, source``
    from every ``*.json`` under ``results_dir``, and notes on what was skipped."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if not os.path.isdir(results_dir):
        return rows, [f"{results_dir} does not exist"]
    for name in sorted(os.listdir(results_dir)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(results_dir, name)
        try:
            with open(path) as f:
                obj = json.load(f)
        except (OSError, ValueError) as e:
            notes.append(f"{name}: skipped, not readable JSON ({e})")
            continue
        if isinstance(obj, dict) and "kernel_cases" in obj:
            notes.append(f"{name}: skipped, a GPU test summary (errors, not latencies)")
            continue
        found = _model_rows(obj, name)
        if not found:
            _walk(obj, name, {}, found)
        if not found:
            notes.append(f"{name}: no records with impl, hidden, tokens and a latency")
        rows.extend(found)
    return rows, notes


def baseline_of(impls: Iterable[str]) -> Optional[str]:
    """The unfused implementation that ratios are taken against."""
    return next((i for i in sorted(impls) if BASELINE.search(i)), None)


def groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Rows by (source, dtype, world size, quantization), each with a title tag for figures."""
    key = lambda r: (r["source"], str(r["dtype"]), str(r["world_size"]), str(r.get("quant") or ""))  # noqa: E731
    out = []
    for k in sorted({key(r) for r in rows}):
        tag = os.path.splitext(k[0])[0] + (f"_{k[3]}" if k[3] else "")
        out.append((tag, [r for r in rows if key(r) == k]))
    return out


def ratios(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """``us / baseline us`` for every other implementation at the same shape."""
    key = lambda r: (r["source"], r["hidden"], r["tokens"], r["dtype"], r["world_size"], r.get("quant"))  # noqa: E731
    base = {key(r): r["us"] for r in rows if r["impl"] == baseline}
    return [{**r, "ratio": r["us"] / base[key(r)]} for r in rows
            if r["impl"] != baseline and not NOT_AN_IMPL.search(r["impl"])
            and key(r) in base and base[key(r)] > 0]


def plot_by_hidden(rows: list[dict[str, Any]], value: str, ylabel: str, title: str,
                   path: Optional[str] = None, hline: Optional[float] = None) -> Any:
    """One panel per hidden size: ``value`` against tokens, one line per implementation."""
    import matplotlib.pyplot as plt

    hiddens = sorted({r["hidden"] for r in rows})
    fig, axes = plt.subplots(1, len(hiddens), figsize=(4.6 * len(hiddens), 3.8), squeeze=False)
    for ax, h in zip(axes[0], hiddens):
        sel = [r for r in rows if r["hidden"] == h]
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["tokens"], r[value]) for r in sel if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"hidden {h}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig

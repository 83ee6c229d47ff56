"""The results tables of README.md and docs/results.md, from the committed JSON (so that the
text says what the files say):

    python benchmarks/readme_tables.py [--results benchmarks/results]            # print the blocks
    python benchmarks/readme_tables.py --write                                   # rewrite them in place
    python benchmarks/readme_tables.py --check                                   # exit 1 where stale

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in its document,
followed by a line naming the hardware, the versions and the commit it comes from.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The README's headline rows; docs/results.md has every row the JSON has.
OP_HEADLINE = ((4096, 1), (4096, 8), (4096, 128), (4096, 2048),
               (8192, 1), (8192, 8), (8192, 128), (8192, 512), (8192, 2048))
MODEL_HEADLINE = ("decode b=8",)
FP8_ROWS = ((2880, 8, "static"), (2880, 8, "per_token"), (4096, 8, "static"),
            (4096, 8, "per_token"), (4096, 8, "group128"), (4096, 80, "group128"),
            (7168, 8, "static"), (7168, 8, "group128"), (8192, 1, "static"),
            (8192, 8, "per_token"), (8192, 80, "group128"), (8192, 512, "group128"))
MODEL_STEPS = ("decode b=1", "decode b=8", "decode b=128", "prefill 2048")

OP_JSON, FP8_JSON = "op_h200x2.json", "op_fp8_h200x2.json"
MODEL_JSON, MODEL_FP8_JSON = "model_h200x2.json", "model_fp8_h200x2.json"


def load(results: str, name: str) -> Any:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def _commit(result: dict) -> str:
    prov = result.get("provenance", {})
    if prov.get("commit", "unknown") != "unknown":
        return f"code at {prov['commit'][:7]}"
    if "committed_in" in prov:
        return f"results committed in {prov['committed_in'][:7]}"
    return "commit unknown"


def source_line(sources: list[tuple[dict, str]], link_prefix: str = "") -> str:
    """Where a table's numbers come from: device, versions, commit, the JSON files
    (``sources``: each result with its path under benchmarks/results/)."""
    result = sources[0][0]
    prov = result.get("provenance", {})
    meta = result.get("meta", {})
    world = prov.get("world_size", meta.get("world_size", "?"))
    device = prov.get("device", meta.get("device", "unknown device"))
    versions = prov.get("versions", {"torch": meta.get("torch", "unknown")})
    names = {"torch": "torch", "triton": "Triton", "flashinfer": "FlashInfer"}
    text = ", ".join(f"{names.get(k, k)} {v}" for k, v in versions.items() if v != "unknown")
    files = "; ".join(f"[{os.path.basename(p)}]({link_prefix}benchmarks/results/{p}) "
                      f"({_commit(r)})" for r, p in sources)
    return f"Source: {world} x {device}, {text}; {files}."


def op_headline(op: dict) -> str:
    rows = {(r["hidden"], r["tokens"]): r for r in op["rows"]}
    out = ["| hidden | tokens | fused us | NCCL + compiled norm us | FlashInfer us "
           "| fused / NCCL | fused / FlashInfer |", "|" + "---|" * 7]
    for key in OP_HEADLINE:
        r = rows.get(key)
        if r is None:
            continue
        fi = r.get("flashinfer")
        vs_fi = f"{r['fused'] / fi:.2f}" if fi else "-"
        out.append(f"| {key[0]} | {key[1]} | {_us(r['fused'])} | {_us(r['nccl'])} | {_us(fi)} | "
                   f"{r['fused'] / r['nccl']:.2f} | {vs_fi} |")
    return "\n".join(out)


def op_table(op: dict) -> str:
    out = ["| hidden | tokens | path | fused us | one-stage us | two-stage us | NCCL + compiled us "
           "| FlashInfer us | barrier us | fused / barrier | fused / NCCL | fused / FlashInfer |",
           "|" + "---|" * 12]
    for r in sorted(op["rows"], key=lambda r: (r["hidden"], r["tokens"])):
        fi = r.get("flashinfer")
        vs_fi = f"{r['fused'] / fi:.2f}" if fi else "-"
        out.append(f"| {r['hidden']} | {r['tokens']} | {r['gate_path']} | {_us(r['fused'])} | "
                   f"{_us(r.get('one_stage'))} | {_us(r.get('two_stage'))} | "
                   f"{_us(r['nccl'])} | {_us(fi)} | {_us(r['barrier'])} | "
                   f"{r['fused'] / r['barrier']:.2f} | {r['fused'] / r['nccl']:.2f} | "
                   f"{vs_fi} |")
    return "\n".join(out)


def targets(op: dict) -> str:
    rows = op["rows"]
    out = ["| target | result | met |", "|---|---|---|"]

    def span(vals: list[float]) -> str:
        return f"{min(vals):.2f}-{max(vals):.2f}"

    for hiddens, bound in (((2880, 4096, 7168, 8192), 1.25), ((12288, 16384), 1.4)):
        per = {h: [r["fused"] / r["barrier"] for r in rows if r["hidden"] == h and r["tokens"] <= 8]
               for h in hiddens}
        per = {h: v for h, v in per.items() if v}  # a hidden size the run left out
        over = sorted((r["hidden"], r["tokens"]) for r in rows if r["hidden"] in hiddens
                      and r["tokens"] <= 8 and r["fused"] / r["barrier"] > bound)
        text = ", ".join(f"{h}: {span(v)}" for h, v in per.items())
        out.append(f"| 1-8 tokens <= {bound} x barrier, hidden {'/'.join(map(str, hiddens))} | "
                   f"{text}; over: {', '.join(f'{h} x {n}' for h, n in over) or 'none'} | "
                   f"{'yes' if not over else 'no'} |")
    r80 = next(r for r in rows if (r["hidden"], r["tokens"]) == (8192, 80))
    ratio = r80["fused"] / r80["nccl"]
    out.append(f"| 8192 x 80: <= 0.35 x NCCL + compiled | {ratio:.3f} | "
               f"{'yes' if ratio <= 0.35 else 'no'} |")
    both = [r for r in rows if "fused_vs_faster_kernel" in r]
    worst = max(both, key=lambda r: r["fused_vs_faster_kernel"])
    over = [r for r in both if r["fused_vs_faster_kernel"] > 1.03]
    out.append(f"| 1..2048 tokens: fused <= 1.03 x the faster kernel (timed next to it) | "
               f"{len(both) - len(over)} of {len(both)} shapes; worst {worst['hidden']} x "
               f"{worst['tokens']} at {worst['fused_vs_faster_kernel']:.3f} | "
               f"{'yes' if not over else 'no'} |")
    fi = [r for r in rows if r["tokens"] <= 512 and r.get("flashinfer")]
    over = [r for r in fi if r["fused"] / r["flashinfer"] > 0.90]
    worst = max(fi, key=lambda r: r["fused"] / r["flashinfer"]) if fi else None
    out.append(f"| 1..512 tokens: <= 0.90 x FlashInfer's best | {len(fi) - len(over)} of "
               f"{len(fi)} shapes"
               + (f"; worst {worst['hidden']} x {worst['tokens']} at "
                  f"{worst['fused'] / worst['flashinfer']:.3f}" if worst else "")
               + "; over: " + (", ".join(
                   f"{r['hidden']} x {r['tokens']} ({r['fused'] / r['flashinfer']:.2f})"
                   for r in over) or "none") + f" | {'yes' if fi and not over else 'no'} |")
    e = op["eager"]
    out.append(f"| eager <= 40 us per call at 8 x 4096 | {e['fused_us_per_call']:.1f} "
               f"(FlashInfer {e.get('flashinfer_us_per_call', float('nan')):.1f}, NCCL + eager "
               f"norm {e['nccl_eager_us_per_call']:.1f}"
               + (f", one torch.add {e['torch_add_us_per_call']:.1f}"
                  if "torch_add_us_per_call" in e else "") + ") | "
               f"{'yes' if e['fused_us_per_call'] <= 40 else 'no'} |")
    return "\n".join(out)


def fp8_table(fp8: dict) -> str:
    rows = {(r["hidden"], r["tokens"], r["quant"]): r for r in fp8["rows"]}
    out = ["| hidden | tokens | quant | fused us | op + compiled quant us | unfused us "
           "| fused / unfused |", "|---|---|---|---|---|---|---|"]
    for key in FP8_ROWS:
        r = rows.get(key)
        if r is not None:
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | {_us(r['fused'])} | "
                       f"{_us(r['fused_noquant'])} | {_us(r['unfused'])} | "
                       f"{r['fused'] / r['unfused']:.2f} |")
    return "\n".join(out)


def fp8_summary(fp8: dict) -> str:
    """Two facts over every row: the worst fused / unfused at 1..80 tokens, and where fused is
    slower than the bf16 op followed by the compiled quantization."""
    small = [r for r in fp8["rows"] if r["tokens"] <= 80]
    worst = max(small, key=lambda r: r["fused"] / r["unfused"])
    slower = [r for r in fp8["rows"] if r["fused"] > r["fused_noquant"]]
    return (f"At 1..80 tokens fused is at most {worst['fused'] / worst['unfused']:.3f} x unfused "
            f"(worst {worst['hidden']} x {worst['tokens']} {worst['quant']}); fused is faster than "
            f"op + compiled quant at {len(fp8['rows']) - len(slower)} of {len(fp8['rows'])} shapes.")


def model_table(*models: dict, steps: tuple[str, ...] = MODEL_STEPS) -> str:
    out = ["| model (8 layers, TP=2) | step | unfused us | fused us | fused/unfused | path "
           "| logits rel. L2 |", "|---|---|---|---|---|---|---|"]
    for result in models:
        for m in result["models"]:
            for s in m["shapes"]:
                label = (f"decode b={s['batch']}" if s["kind"] == "decode"
                         else f"prefill {s['tokens']}")
                if label not in steps:
                    continue
                out.append(f"| {m['name']} | {label} | {s['unfused']['median_us']:.1f} | "
                           f"{s['fused']['median_us']:.1f} | {s['ratio']:.3f} | "
                           f"{', '.join(s['paths'])} | "
                           f"{s['logits']['fused_vs_unfused']['rel_l2']:.1e} |")
    return "\n".join(out)


def blocks(results: str) -> dict[str, dict[str, str]]:
    """Document (relative to the repository root) -> table name -> its markdown."""
    op, fp8 = load(results, OP_JSON), load(results, FP8_JSON)
    bf16, mfp8 = load(results, MODEL_JSON), load(results, MODEL_FP8_JSON)

    op_src, fp8_src = [(op, OP_JSON)], [(fp8, FP8_JSON)]
    model_src = [(bf16, MODEL_JSON), (mfp8, MODEL_FP8_JSON)]

    def with_source(table: str, sources: list[tuple[dict, str]], prefix: str) -> str:
        return table + "\n\n" + source_line(sources, link_prefix=prefix)

    readme = {
        "op": with_source(op_headline(op), op_src, ""),
        "model": with_source(model_table(bf16, mfp8, steps=MODEL_HEADLINE), model_src, ""),
    }
    results_md = {
        "op": with_source(op_table(op), op_src, "../"),
        "targets": targets(op),
        "fp8": with_source(fp8_table(fp8) + "\n\n" + fp8_summary(fp8), fp8_src, "../"),
        "model": with_source(model_table(bf16, mfp8), model_src, "../"),
    }
    return {"README.md": readme, "docs/results.md": results_md}


def _marker(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /table:{re.escape(name)} -->)",
                      re.S)


def render(text: str, tables: dict[str, str]) -> str:
    """``text`` with every named block replaced by its table; a block the text lacks is an error."""
    for name, table in tables.items():
        pattern = _marker(name)
        if not pattern.search(text):
            raise ValueError(f"no <!-- table:{name} --> block")
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


def stale(results: str, root: str = ROOT, write: bool = False) -> list[str]:
    """The documents whose blocks differ from the JSON (rewritten when ``write``)."""
    out = []
    for doc, tables in blocks(results).items():
        path = os.path.join(root, doc)
        with open(path) as f:
            text = f.read()
        new = render(text, tables)
        if new != text:
            out.append(doc)
            if write:
                with open(path, "w") as f:
                    f.write(new)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = ap.parse_args(argv)
    if args.write or args.check:
        docs = stale(args.results, write=args.write)
        verb = "rewrote" if args.write else "stale"
        print(f"{verb}: {', '.join(docs)}" if docs else "up to date")
        return 1 if docs and args.check else 0
    show: Callable[[str], None] = print
    for doc, tables in blocks(args.results).items():
        for name, table in tables.items():
            show(f"<!-- {doc} table:{name} -->\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

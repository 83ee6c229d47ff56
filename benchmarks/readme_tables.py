"""The README's results tables, from the committed JSON (so that the README says
what the files say):

    python benchmarks/readme_tables.py [--results benchmarks/results]

Prints markdown: the op table (selected rows) and issue 14's targets computed
from ``op_h200x2.json``, the FP8 op table, the model step table.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

OP_ROWS = {2880: (1, 8, 80, 128, 512, 2048), 4096: (1, 8, 80, 128, 512, 2048),
           7168: (1, 8, 80, 128, 512, 2048), 8192: (1, 8, 80, 128, 512, 2048),
           12288: (1, 8, 80, 512, 2048), 16384: (1, 8, 80, 512, 2048)}
FP8_ROWS = ((2880, 8, "static"), (2880, 8, "per_token"), (4096, 8, "static"),
            (4096, 8, "per_token"), (4096, 8, "group128"), (4096, 80, "group128"),
            (7168, 8, "static"), (7168, 8, "group128"), (8192, 1, "static"),
            (8192, 8, "per_token"), (8192, 80, "group128"), (8192, 512, "group128"))
MODEL_STEPS = ("decode b=1", "decode b=8", "decode b=128", "prefill 2048")


def load(results: str, name: str) -> Any:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def op_table(op: dict) -> str:
    rows = {(r["hidden"], r["tokens"]): r for r in op["rows"]}
    out = ["| hidden | tokens | path | fused us | one-stage us | two-stage us | NCCL + compiled us "
           "| FlashInfer us | barrier us | fused / barrier | fused / NCCL | fused / FlashInfer |",
           "|" + "---|" * 12]
    for hidden, counts in OP_ROWS.items():
        for n in counts:
            r = rows.get((hidden, n))
            if r is None:
                continue
            fi = r.get("flashinfer")
            vs_fi = f"{r['fused'] / fi:.2f}" if fi else "-"
            out.append(f"| {hidden} | {n} | {r['gate_path']} | {_us(r['fused'])} | "
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


def model_table(*models: dict) -> str:
    out = ["| model (8 layers, TP=2) | step | unfused us | fused us | fused/unfused | path "
           "| logits rel. L2 |", "|---|---|---|---|---|---|---|"]
    for result in models:
        for m in result["models"]:
            for s in m["shapes"]:
                label = (f"decode b={s['batch']}" if s["kind"] == "decode"
                         else f"prefill {s['tokens']}")
                if label not in MODEL_STEPS:
                    continue
                out.append(f"| {m['name']} | {label} | {s['unfused']['median_us']:.1f} | "
                           f"{s['fused']['median_us']:.1f} | {s['ratio']:.3f} | "
                           f"{', '.join(s['paths'])} | "
                           f"{s['logits']['fused_vs_unfused']['rel_l2']:.1e} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="benchmarks/results")
    args = ap.parse_args()
    op = load(args.results, "op_h200x2.json")
    print(op_table(op), "", targets(op), "", fp8_table(load(args.results, "op_fp8_h200x2.json")),
          "", model_table(load(args.results, "model_h200x2.json"),
                          load(args.results, "model_fp8_h200x2.json")), sep="\n")


if __name__ == "__main__":
    main()

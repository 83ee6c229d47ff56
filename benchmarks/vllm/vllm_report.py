"""What a vLLM benchmark's results say, as text, read from its JSON alone: the primary
metrics the A/A verdict and the comparisons are about, and each benchmark's lines per model.
Only the standard library and ``paired_ratios``, so that the end of a run prints it in a
second or two, without importing torch or vLLM."""

from __future__ import annotations

from typing import Any

import paired_ratios

OFFLINE_PRIMARY = ("tpot_", "prefill")
"""``bench_vllm.py``'s metrics compared (prefixes): TPOT per batch, prefill."""
FIRST_PREFILL = "first_call_prefill"
"""With ``bench_vllm.py --prefill-calls`` K > 1, each turn's first prefill call, ms: what one
call a turn measures, beside the K calls' median in the same rounds. Secondary: its name
starts with no primary prefix, so the A/A verdict and the precision are the median's."""
SERVING_PRIMARY = ("median_tpot", "median_itl", "output_throughput")
"""``bench_serve.py``'s metrics compared (prefixes), per concurrency."""
SERVING_NAMES = {"median_tpot": "median TPOT", "median_itl": "median ITL",
                 "output_throughput": "output throughput"}


def band_verdict(stats: dict[str, Any]) -> str:
    """A ratio against :data:`paired_ratios.BAND`: ``inside`` (its median and its 95 %
    interval), ``median inside, interval not``, ``inside, no 95 % interval`` (too few
    rounds for one) or ``OUTSIDE``."""
    lo, hi = paired_ratios.BAND
    if not lo <= stats["median"] <= hi:
        return "OUTSIDE"
    if not paired_ratios.covered(stats):
        return f"inside, no 95 % interval in {stats['rounds']} rounds"
    return "inside" if lo <= stats["ci"][0] and stats["ci"][1] <= hi else \
        "median inside, interval not"


def serving_aa_lines(result: dict[str, Any]) -> list[str]:
    """The serving A/A pair at each concurrency: median TPOT, median ITL and output
    throughput, each ratio with its 95 % interval and its verdict."""
    band = "[{:.2f}, {:.2f}]".format(*paired_ratios.BAND)
    out = [f"A/A serving by concurrency (twin/variant; band {band}: inside = the median and "
           "its 95 % interval inside)"]
    for m in result["models"]:
        pair = m["aa"].get("pair")
        name = m["model"]["name"] + _wave(m, result["models"], " (")
        if not pair or pair not in m["comparisons"]:
            out.append(f"  {name}: no A/A pair measured")
            continue
        for c in result["settings"]["concurrency"]:
            parts = []
            for metric, label in SERVING_NAMES.items():
                st = m["comparisons"][pair].get(f"{metric}_c{c}")
                parts.append(f"{label} -" if st is None else
                             f"{label} {st['median']:.3f} [{st['ci'][0]:.3f}, {st['ci'][1]:.3f}] "
                             f"{band_verdict(st)}")
            out.append(f"  {name} {pair} c{c}: " + "; ".join(parts))
    return out


def header(result: dict[str, Any], more: str) -> str:
    """The first line of a benchmark's text: what ran, where, and ``more``."""
    meta, st = result["meta"], result["settings"]
    return (f"{result['benchmark']}: TP={st['tp']}, {st['dtype']}, {meta['devices'][0]}, "
            f"vLLM {meta['versions']['vllm']}, kernels {st['kernel_choice']}, {more}")


def plan_lines(result: dict[str, Any]) -> list[str]:
    """The waves the engines ran in and what they were sized against (``wave_plan.py``)."""
    plan = result.get("plan")
    if not plan:
        return []
    free = plan["gpu_free_gib"]
    out = [f"plan: {len(plan['waves'])} wave(s), " + (
        "GPU memory not known" if free is None else
        f"GPU free {', '.join(f'{x:.2f}' for x in free)} GiB, margin {plan['margin_gib']:.2f}")]
    for i, w in enumerate(plan["waves"]):
        done = result.get("waves", [])
        took = f", {done[i]['seconds']} s" if i < len(done) and "seconds" in done[i] else ""
        rec = done[i] if i < len(done) else {}
        held = ""
        if rec.get("held_not_measured"):
            held = f"; held not measured: {rec['held_not_measured']}"
        elif rec.get("gib_held_per_gpu") is not None:
            held = (f"; engines {rec['gib_planned_engines']:.2f} planned, "
                    f"{rec['gib_held_per_gpu']:.2f} held once measured")
        out.append(f"  wave {i + 1}: {w['model']} {', '.join(w['labels'])} "
                   f"({w['gib_per_gpu']:.2f} GiB per GPU{took}{held})")
    out += [f"  NOT PLANNED {k}: {why}" for k, why in plan.get("unplanned", {}).items()]
    return out


def overlap_lines(result: dict[str, Any]) -> list[str]:
    """Where the engines' processes ran; a warning where the measurements overlapped a job
    they were to wait for."""
    out = []
    cp = result.get("cpu_placement")
    if cp:
        pl = cp.get("placement")
        where = (f"pinned: frontend {pl['frontend']}, engine core {pl['core']}"
                 + (f", workers {pl['workers']}" if pl["workers"] else "")
                 + f", benchmark {len(pl['driver'])} CPUs") if pl else \
            f"left to the scheduler{' (' + cp['why'] + ')' if cp.get('why') else ''}"
        missing = {n: e["missing"] for n, e in cp.get("engines", {}).items() if "missing" in e}
        failed = cp.get("no_halt_error") or cp.get("no_halt_failed")
        out.append(f"CPUs: {where}" + (f"; no CPU halts ({len(cp['no_halt'])} kept busy)"
                                       if cp.get("no_halt") else "")
                   + (f"; WARNING: processes not found {missing}" if missing else "")
                   + (f"; WARNING: busy loops not started: {failed}" if failed else ""))
    after = result.get("after_pid")
    if after and not after["ended"]:
        out.append(f"WARNING: measured while process {after['pid']} still ran (it was to end "
                   "within the start-up time)")
    return out


def _wave(model: dict[str, Any], models: list[dict[str, Any]], sep: str = ", ") -> str:
    """", wave N" where a model's engines were split over several waves (each with its own
    results)."""
    if "wave" not in model or sum(m["model"]["name"] == model["model"]["name"]
                                  for m in models) < 2:
        return ""
    return f"{sep}wave {model['wave']}" + (")" if sep.startswith(" (") else "")


def offline_lines(result: dict[str, Any]) -> list[str]:
    """Per model: each engine's primary numbers, CPU load and clocks, its fusion records
    and compiled digests, then the comparisons with the A/A ratio beside each."""
    lines = [header(result, f"attention {result['attention_backend']['requested'] or 'auto'}"),
             *plan_lines(result), *overlap_lines(result)]
    for m in result["models"]:
        lines.append(f"== {m['model']['name']} (hidden {m['model']['hidden']}, "
                     f"{m['model']['layers']} layers{_wave(m, result['models'])}): "
                     f"{m['rounds']['timed']} rounds "
                     f"({m['rounds']['stopped_because']})")
        for label, e in m["engines"].items():
            if not e["run"]:
                lines.append(f"  {label:10} not run: {e['not_run_reason']}")
                continue
            ms = "  ".join(f"{k} {v:.3f}" for k, v in e["ms"].items()
                           if v is not None and k.startswith(OFFLINE_PRIMARY))
            load = [c["engine_cpu_load"] for c in e["calls"].values() if c["engine_cpu_load"]]
            mhz = [c["sm_mhz"] for c in e["calls"].values() if c["sm_mhz"]]
            lines.append(f"  {label:10} ms: {ms}")
            lines.append(f"  {'':10} engine CPU load {min(load, default=0):.2f}-"
                         f"{max(load, default=0):.2f} cores, SM clock "
                         f"{'-' if not mhz else f'{min(mhz):.0f}-{max(mhz):.0f} MHz'}, "
                         f"up in {e['seconds_to_start']} s")
            fused = {rk: {rng: f"{x['fused']}/{x['sites']}" for rng, x in rr.items()}
                     for rk, rr in e["fusion"]["sites_per_range"].items()}
            if fused:
                lines.append(f"  {'':10} fused/sites per range: {fused}")
            for k, c in (e.get("compiled") or {}).items():
                if k.startswith("vs_"):
                    picks = "same" if c["same_picks"] else f"DIFFER ({c['different_picks']})"
                    kernels = "same" if c["same_kernels"] else "DIFFER"
                    graphs = "same" if c["same_graphs"] else "DIFFER"
                    lines.append(f"  {'':10} compiled {k.replace('_', ' ')}: kernels "
                                 f"{kernels}, graphs {graphs}, picks {picks}")
        lines += paired_ratios.comparison_lines(m, OFFLINE_PRIMARY)
        lines += first_prefill_lines(m)
        lines.append(f"  greedy tokens identical across engines: {m['tokens']['identical']}")
    return lines


def first_prefill_lines(model: dict[str, Any]) -> list[str]:
    """Each comparison's prefill from the first call of each turn alone, beside the median
    of the turn's calls: whether more calls a turn narrowed it (nothing with one call)."""
    out = []
    for name, cmp in model["comparisons"].items():
        if FIRST_PREFILL in cmp and "prefill" in cmp:
            out.append(f"  {name} prefill, the median of a turn's calls "
                       f"{paired_ratios.ratio_text(cmp['prefill'])}, the first call alone "
                       f"{paired_ratios.ratio_text(cmp[FIRST_PREFILL])}")
    return out


def _decode_prefills(runs: list[dict[str, Any]]) -> str:
    """Per concurrency, each round's median count of prefill steps in a request's decode
    (``bench_serve.decode_prefills``): the same in every round where arrivals are steady."""
    by: dict[int, list[str]] = {}
    for r in runs:
        d = r.get("decode_prefills")
        if d:
            by.setdefault(r["concurrency"], []).append(f"{d['median']:g}")
    return "  ".join(f"c{c} {' '.join(v)}" for c, v in by.items())


def serving_lines(result: dict[str, Any]) -> list[str]:
    """Per model: each server's medians and how it compiled, then the comparisons
    with the A/A ratio beside each."""
    st = result["settings"]
    lines = [header(result, f"input {st['input_len']} / output {st['output_len']} "
                            f"tokens, concurrency {st['concurrency']}"), *plan_lines(result),
             *overlap_lines(result)]
    for m in result["models"]:
        lines.append(f"== {m['model']['name']}{_wave(m, result['models'], ' (')}: "
                     f"{m['rounds']['timed']} rounds "
                     f"({m['rounds']['stopped_because']})")
        spacing = (m.get("arrival") or {}).get("spacing_s") or {}
        if spacing:
            at_once = [str(c) for c in result["settings"]["concurrency"]
                       if str(c) not in spacing]
            lines.append("  requests sent " + ", ".join(
                f"{1000 * x:.0f} ms apart at concurrency {c}" for c, x in spacing.items())
                + (f", at once at {', '.join(at_once)}" if at_once else ""))
        for label, s in m["servers"].items():
            if not s["run"]:
                lines.append(f"  {label:10} not run: {s['not_run_reason']}")
                continue
            lines.append(f"  {label:10} " + "  ".join(
                f"{k} {v:.2f}" for k, v in s["median"].items() if v is not None)
                + f"  ({s['compile']}, up in {s['seconds_to_start']} s)")
            steps = _decode_prefills(s.get("runs") or [])
            if steps:
                lines.append(f"  {'':10} prefill steps in a request's decode, median per "
                             f"round: {steps}")
        lines += paired_ratios.comparison_lines(m, SERVING_PRIMARY)
    return lines

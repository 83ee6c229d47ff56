"""Ratios between engines measured in the same rounds, and the A/A check.

Every engine is measured once per round, one at a time, in :func:`round_order`; a
comparison is the median over rounds of the per-round ratio (engine / baseline in the
same round), so drift that spans rounds (clocks, temperature, other load) divides out.
Its confidence interval for the median is distribution-free: order statistics of the
per-round ratios (binomial coverage).  The A/A pair is two engines of one variant,
measured exactly as the variants are: its ratio, beside every comparison, is what the
benchmark reads as no difference, and it must stay inside :data:`BAND`.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence, TypeVar

BAND = (0.99, 1.01)
LEVEL = 0.95
"""The coverage a ratio's interval must have to count as one: with fewer than six rounds
no pair of order statistics covers the median with 95 %, and the interval given is only
the range of the rounds (its ``ci_coverage`` says how much less)."""
T = TypeVar("T")


def round_order(items: Sequence[T], rnd: int) -> list[T]:
    """The order of round ``rnd``: rounds come in pairs, forward then backward (a drift
    linear in time hits every engine equally over a pair), and each pair starts one
    engine later (over ``2 * len(items)`` rounds each engine goes first equally often)."""
    k = (rnd // 2) % max(len(items), 1)
    order = list(items[k:]) + list(items[:k])
    return order[::-1] if rnd % 2 else order


def _fair_cdf(k: int, n: int) -> float:
    """P(X <= k) for X the number of heads in ``n`` fair coin tosses (a value's side of the
    median, a round's side of 1)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n


def median_ci(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """``(low, high, coverage)``: the widest-inside order statistics ``x_(k), x_(n+1-k)``
    that cover the median with probability >= ``level``; with too few values for that,
    the smallest and largest and the coverage they have."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n+1-k))
        return 1.0 - 2.0 * _fair_cdf(k - 1, n)

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def ratio_stats(num: Sequence[Optional[float]], den: Sequence[Optional[float]],
                level: float = LEVEL) -> Optional[dict[str, Any]]:
    """Per-round ratios ``num / den`` (rounds where either is missing or the baseline is
    not positive left out) and their median, range and confidence interval; None
    without any round."""
    # float(): serving metrics arrive as numpy scalars, which the results' JSON cannot hold.
    rs = [float(a) / float(b) for a, b in zip(num, den)
          if a is not None and b is not None and b > 0]
    if not rs:
        return None
    lo, hi, cov = median_ci(rs, level)
    return {"median": statistics.median(rs), "ci": [lo, hi], "ci_coverage": round(cov, 4),
            "min": min(rs), "max": max(rs), "rounds": len(rs),
            "above": sum(r > 1.0 for r in rs), "below": sum(r < 1.0 for r in rs),
            "per_round": [round(r, 5) for r in rs]}


def sign_p(k: int, n: int) -> float:
    """Two-sided sign test: the probability that ``k`` or more of ``n`` rounds fall on one
    side of 1, or as many on the other, when either side is as likely as the other."""
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * _fair_cdf(n - max(k, n - k), n))


def one_sided(stats: dict[str, Any], level: float = LEVEL) -> Optional[str]:
    """``"above"`` or ``"below"`` where more rounds' ratios lie on that side of 1 than
    chance allows (sign test, rounds equal to 1 left out, probability under ``1 - level``:
    six of six at least, 10 of 11, 15 of 19, 18 of 24); else None.  For an A/A pair this is
    an offset that lasts as long as the engines: more rounds narrow the interval around it
    but do not remove it."""
    above, below = stats.get("above", 0), stats.get("below", 0)
    if sign_p(max(above, below), above + below) >= 1.0 - level:
        return None
    return "above" if above > below else "below"


def fewest_rounds(level: float = LEVEL) -> int:
    """The fewest rounds whose order statistics can cover the median with ``level``: six for
    95 % (the smallest and largest of n rounds cover it with ``1 - 2 * 0.5 ** n``)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"a coverage is between 0 and 1, not {level}")
    n = 1
    while 1.0 - 2.0 * 0.5 ** n < level:
        n += 1
    return n


MOST_ROUNDS = 200
"""Where :func:`rounds_needed` stops looking."""


def _binomial(k: int, p: float) -> list[float]:
    """P(X = i) for i = 0..k, X the number of ``k`` rounds on one side, each with ``p``."""
    if p <= 0.0 or p >= 1.0:
        return [float(i == (k if p >= 1.0 else 0)) for i in range(k + 1)]
    lp, lq = math.log(p), math.log1p(-p)
    return [math.exp(math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1)
                     + i * lp + (k - i) * lq) for i in range(k + 1)]


def _median_below(ratios: Sequence[float], bound: float, k: int) -> float:
    """P(the median of ``k`` rounds drawn from ``ratios`` with replacement < ``bound``).  Odd
    ``k``: more than half of them below.  Even ``k = 2m``: the mean of the middle two below,
    so m + 1 or more below, or exactly m below and the largest of those plus the smallest of
    the others under ``2 * bound``."""
    below = [r for r in ratios if r < bound]
    rest = [r for r in ratios if r >= bound]
    pmf = _binomial(k, len(below) / len(ratios))
    m = k // 2
    out = sum(pmf[m + 1:])
    if k % 2 or not below or not rest or pmf[m] == 0.0:
        return out
    tie = 0.0
    for v in sorted(set(below)):  # v the largest of the m drawn below
        at_most = sum(b <= v for b in below) / len(below)
        under = sum(b < v for b in below) / len(below)
        # The smallest of the m others under 2 * bound - v: not all of them at or above it.
        others_above = sum(r >= 2.0 * bound - v for r in rest) / len(rest)
        tie += (at_most ** m - under ** m) * (1.0 - others_above ** m)
    return out + pmf[m] * tie


def outside_share(ratios: Sequence[float], k: int, band: tuple[float, float] = BAND) -> float:
    """How often the median of ``k`` rounds drawn from ``ratios`` with replacement falls
    outside ``band``: the bootstrap of those rounds, in closed form (the two sides exclude
    each other; the side above is the side below of the ratios negated)."""
    if not ratios or k < 1:
        raise ValueError("no rounds to draw from, or none to draw")
    return (_median_below(ratios, band[0], k)
            + _median_below([-r for r in ratios], -band[1], k))


def shares_outside(ratios: Sequence[float],
                   band: tuple[float, float] = BAND) -> tuple[float, float]:
    """The shares of ``ratios`` below and above ``band``."""
    n = len(ratios)
    return sum(r < band[0] for r in ratios) / n, sum(r > band[1] for r in ratios) / n


def rounds_needed(ratios: Sequence[float], band: tuple[float, float] = BAND,
                  level: float = LEVEL) -> Optional[int]:
    """The fewest rounds (from :func:`fewest_rounds` up) whose median ratio stays inside
    ``band`` with probability ``level`` were rounds drawn like those measured
    (:func:`outside_share`), the next number of rounds too (an odd and an even number
    shrink the chance at different rates; past both, more rounds only shrink it further).
    None where that is not reached by :data:`MOST_ROUNDS`, and at once where half or more
    of the rounds lie on one side outside the band: an offset, which no number of rounds
    removes.  A plug-in estimate, as good as the rounds it draws from: with six of them a
    share is known to a sixth."""
    if not ratios:
        return None
    if max(shares_outside(ratios, band)) >= 0.5:
        return None
    miss = 1.0 - level
    k = fewest_rounds(level)
    while k < MOST_ROUNDS:
        if outside_share(ratios, k, band) <= miss and \
                outside_share(ratios, k + 1, band) <= miss:
            return k
        k += 1
    return None


def covered(stats: dict[str, Any], level: float = LEVEL) -> bool:
    """Whether a ratio's interval has the coverage ``level`` (enough rounds for it)."""
    return stats.get("ci_coverage", 0.0) >= level


def half_width(stats: dict[str, Any]) -> float:
    """Half the confidence interval's width, relative to the median."""
    lo, hi = stats["ci"]
    return (hi - lo) / 2.0 / stats["median"]


def compare(per_round: dict[str, dict[str, list[Optional[float]]]], base: str,
            aa: Optional[tuple[str, str]], higher_is_better: Sequence[str] = ()) -> dict[str, Any]:
    """Every engine's per-round metrics against ``base``'s, ``{"<label>/<base>": {metric:
    stats}}``, and the A/A pair's, ``aa = (twin, its variant)``, as ``"<twin>/<variant>"``
    with its stats beside every other comparison's of the same metric.
    ``higher_is_better`` names metrics that are rates (throughputs); the rest are times
    (< 1: faster than the baseline)."""
    if base not in per_round:
        return {}
    pair: dict[str, Any] = {}
    if aa is not None and aa[0] in per_round and aa[1] in per_round:
        pair = {m: s for m, v in per_round[aa[1]].items()
                if (s := ratio_stats(per_round[aa[0]].get(m, []), v)) is not None}
    out: dict[str, Any] = {}
    if pair:
        out[f"{aa[0]}/{aa[1]}"] = {m: {**s, "kind": _kind(m, higher_is_better)}
                                   for m, s in pair.items()}
    for label, metrics in per_round.items():
        if label == base or (pair and label == aa[0]):
            continue
        cmp: dict[str, Any] = {}
        for m, values in metrics.items():
            s = ratio_stats(values, per_round[base].get(m, []))
            if s is None:
                continue
            s["kind"] = _kind(m, higher_is_better)
            if m in pair:
                s["aa"] = {k: pair[m][k] for k in ("median", "ci", "rounds")}
            cmp[m] = s
        out[f"{label}/{base}"] = cmp
    return out


def _kind(metric: str, rates: Sequence[str]) -> str:
    return "rate" if metric in rates else "time"


def aa_verdict(comparisons: dict[str, Any], pair: Optional[str], primary: tuple[str, ...],
               band: tuple[float, float] = BAND) -> dict[str, Any]:
    """Whether the A/A pair's median ratio stays inside ``band`` at every primary metric
    (names starting with one of ``primary``), which metrics leave it (the secondary ones
    apart), and whether the primary metrics' 95 % intervals stay inside too: an interval
    of too few rounds to cover the median with 95 % is not one (``ci_short``)."""
    if pair is None or pair not in comparisons:
        return {"pair": pair, "band": list(band), "within": None,
                "note": "no A/A pair measured"}
    stats = comparisons[pair]
    first = {m: s for m, s in stats.items() if m.startswith(primary)}
    outside = {m: round(s["median"], 4) for m, s in stats.items()
               if not band[0] <= s["median"] <= band[1]}
    ci_outside = {m: [round(x, 4) for x in s["ci"]] for m, s in first.items()
                  if not (band[0] <= s["ci"][0] and s["ci"][1] <= band[1])}
    ci_short = sorted(m for m, s in first.items() if not covered(s))
    sided = {m: f"{s['median']:.3f}, {side} 1 in {s[side]} of {s['rounds']} rounds"
             for m, s in first.items() if (side := one_sided(s)) is not None}
    return {"pair": pair, "band": list(band), "primary": list(primary),
            "within": bool(first) and not set(outside) & set(first),
            "outside": {m: x for m, x in outside.items() if m in first},
            "secondary_outside": {m: x for m, x in outside.items() if m not in first},
            "ci_within": bool(first) and not ci_outside and not ci_short,
            "ci_outside": ci_outside, "ci_short": ci_short, "one_sided": sided,
            "rounds_needed": {m: rounds_needed(s["per_round"], band) for m, s in first.items()
                              if s.get("per_round")}}


def wanted(stats: dict[str, dict[str, Any]], primary: tuple[str, ...],
           band: tuple[float, float] = BAND) -> dict[str, str]:
    """The primary metrics of an A/A pair (``{metric: stats}``) whose rounds spread wider than
    the rounds measured can hold inside ``band``: ``{metric: "N rounds (M measured)"}``,
    "more than MOST_ROUNDS", or "no number of rounds" where a side's share is half or more
    (:func:`rounds_needed`)."""
    out = {}
    for m, s in stats.items():
        # Fewer rounds than an interval needs say too little of their spread to count on.
        if not m.startswith(primary) or len(s.get("per_round", ())) < fewest_rounds():
            continue
        k = rounds_needed(s["per_round"], band)
        lo, hi = shares_outside(s["per_round"], band)
        if k is None and max(lo, hi) >= 0.5:
            side = "below" if lo >= 0.5 else "above"
            out[m] = (f"no number of rounds (an offset: {round(max(lo, hi) * s['rounds'])} of "
                      f"{s['rounds']} rounds {side} the band)")
        elif k is None:
            out[m] = f"more than {MOST_ROUNDS} rounds ({s['rounds']} measured)"
        elif k > s["rounds"]:
            out[m] = f"{k} rounds ({s['rounds']} measured)"
    return out


def wanted_line(name: str, stats: dict[str, dict[str, Any]], primary: tuple[str, ...]) -> list[str]:
    """:func:`wanted` as a line of text, none where the rounds measured are enough."""
    w = wanted(stats, primary)
    if not w:
        return []
    return [f"  {name}: rounds for its median to fall inside the band 19 times in 20, drawn like "
            "these rounds: " + ", ".join(f"{m} {x}" for m, x in w.items())]


def precise_enough(comparisons: dict[str, Any], target: float) -> bool:
    """Every ratio's 95 % interval within ``target`` of its median (half-width); never
    with too few rounds for such an interval (the range of two rounds is not one)."""
    return all(covered(s) and half_width(s) <= target
               for cmp in comparisons.values() for s in cmp.values())


def overall(verdicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Several models' A/A verdicts in one: inside the band at every primary metric, or
    where not; the secondary metrics outside it."""
    measured = {n: v for n, v in verdicts.items() if v.get("within") is not None}
    return {"band": list(BAND),
            "within": all(v["within"] for v in measured.values()) if measured else None,
            "outside": {n: v["outside"] for n, v in measured.items() if v["outside"]},
            "secondary_outside": {n: v["secondary_outside"] for n, v in measured.items()
                                  if v["secondary_outside"]},
            "ci_within": all(v["ci_within"] for v in measured.values()) if measured else None,
            "ci_outside": {n: v["ci_outside"] for n, v in measured.items() if v.get("ci_outside")},
            "ci_short": {n: v["ci_short"] for n, v in measured.items() if v.get("ci_short")},
            "one_sided": {n: v["one_sided"] for n, v in measured.items() if v.get("one_sided")}}


def aa_lines(name: str, models: list[dict[str, Any]], primary: tuple[str, ...]) -> list[str]:
    """The A/A verdict of a run as text, first the verdict, then each model's pair."""
    v = overall({m["model"]["name"]: m["aa"] for m in models})
    band = "[{:.2f}, {:.2f}]".format(*BAND)
    def listed(per_model: dict[str, dict[str, Any]]) -> str:
        def value(x: Any) -> str:
            return f"{x:.3f}" if isinstance(x, float) else f"[{x[0]:.3f}, {x[1]:.3f}]"
        return "; ".join(f"{n} {', '.join(f'{k} {value(x)}' for k, x in o.items())}"
                         for n, o in per_model.items())

    def listed_names(per_model: dict[str, list[str]]) -> str:
        return "; ".join(f"{n} {', '.join(ms)}" for n, ms in per_model.items())

    if v["within"] is None:
        lines = [f"A/A {name}: no A/A pair measured"]
    elif v["within"]:
        why = [*([f"NOT all inside ({listed(v['ci_outside'])})"] if v["ci_outside"] else []),
               *([f"too few rounds for one: {listed_names(v['ci_short'])}"]
                 if v["ci_short"] else [])]
        lines = [f"A/A {name}: within {band} at every primary metric ({', '.join(primary)}); "
                 f"95 % intervals {'inside too' if v['ci_within'] else '; '.join(why)}"]
    else:
        lines = [f"A/A {name}: OUTSIDE {band} at {listed(v['outside'])}"]
    if v.get("secondary_outside"):
        lines.append(f"  secondary metrics outside {band}: {listed(v['secondary_outside'])}")
    if v.get("one_sided"):
        lines.append("  on one side of 1 in more rounds than chance allows (sign test, 5 %: an "
                     "offset of an engine, which more rounds do not remove): " + "; ".join(
                         f"{n} {', '.join(f'{k} {x}' for k, x in o.items())}"
                         for n, o in v["one_sided"].items()))
    for m in models:
        pair = m["aa"].get("pair")
        if pair and pair in m["comparisons"]:
            lines.append(f"  {m['model']['name']} {pair}: " + "  ".join(
                f"{k} {s['median']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}]"
                + ("" if covered(s) else f" (the range of {s['rounds']} rounds)")
                for k, s in m["comparisons"][pair].items() if k.startswith(primary)))
            lines += wanted_line(f"{m['model']['name']} {pair}", m["comparisons"][pair], primary)
    return lines


def ratio_text(stats: dict[str, Any]) -> str:
    """A ratio's median and its 95 % interval, or the range of too few rounds for one."""
    return f"{stats['median']:.3f} [{stats['ci'][0]:.3f}, {stats['ci'][1]:.3f}]" + (
        "" if covered(stats) else f" (range of {stats['rounds']})")


def comparison_lines(model: dict[str, Any], primary: tuple[str, ...]) -> list[str]:
    """A model's comparisons as text, each ratio with its 95 % interval (or the range of
    too few rounds for one) and the A/A pair's ratio beside it (the pair's own lines are
    :func:`aa_lines`')."""
    out = []
    for name, cmp in model["comparisons"].items():
        if name == model["aa"].get("pair"):
            continue
        out.append(f"  {name}: " + "  ".join(
            f"{k} {ratio_text(s)}" + (f" (A/A {s['aa']['median']:.3f})" if "aa" in s else "")
            for k, s in cmp.items() if k.startswith(primary)))
    return out

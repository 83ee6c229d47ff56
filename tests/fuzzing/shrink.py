"""Shrinking a wrong case: drop outputs, and the lines nothing reads, while it stays wrong.

Each round makes every case one step smaller than the current one (one output fewer,
or one line fewer, with the lines that only it read), runs them all on the pairs of
ranks, and keeps the smallest that is still wrong; it stops when none is.  What is
left is the case to turn into a regular test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from . import pair

_ASSIGNED = re.compile(r"^\s*([\w\s,]+?)\s*=(?!=)")
_ALL_REDUCE = re.compile(r"\b(?:fc\.all_reduce|_c10d_functional\.all_reduce|vllm\.all_reduce)\(")


@dataclass(frozen=True)
class _Case:
    head: str
    """The source up to and including ``def f(...):``."""
    lines: tuple[str, ...]
    outputs: tuple[str, ...]

    @staticmethod
    def parse(source: str) -> "_Case":
        head, body = source.split("\ndef f(", 1)
        signature, rest = body.split("\n", 1)
        lines = rest.rstrip("\n").split("\n")
        ret = lines.pop()
        outputs = ret.strip()[len("return ("):-1].rstrip(",")
        return _Case(f"{head}\ndef f({signature}\n", tuple(lines), _split(outputs))

    def render(self) -> str:
        count = sum(len(_ALL_REDUCE.findall(line)) for line in self.lines)
        head = re.sub(r"^ALL_REDUCES = \d+$", f"ALL_REDUCES = {count}", self.head, flags=re.M)
        outs = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        return head + "\n".join(self.lines) + f"\n    return ({outs})\n"

    @property
    def size(self) -> int:
        return len(self.lines) + len(self.outputs)

    def dead(self) -> Optional[int]:
        """The index of a line that no later line or output reads, or None."""
        for i, line in enumerate(self.lines):
            m = _ASSIGNED.match(line)
            names = [n.strip() for n in m.group(1).split(",")] if m else []
            later = "\n".join(self.lines[i + 1:] + self.outputs)
            if names and not any(re.search(rf"\b{re.escape(n)}\b", later) for n in names):
                return i
        return None

    def without_dead(self) -> "_Case":
        case = self
        while (i := case.dead()) is not None:
            case = _Case(case.head, case.lines[:i] + case.lines[i + 1:], case.outputs)
        return case

    def smaller(self) -> list["_Case"]:
        """Every case one step smaller: an output fewer, or a line fewer (a line nothing
        reads, as the case was written), each with the lines that then nothing reads."""
        found = [_Case(self.head, self.lines, self.outputs[:i] + self.outputs[i + 1:])
                 for i in range(len(self.outputs)) if len(self.outputs) > 1]
        if (i := self.dead()) is not None:
            found.append(_Case(self.head, self.lines[:i] + self.lines[i + 1:], self.outputs))
        return [c.without_dead() for c in found]


def _split(outputs: str) -> tuple[str, ...]:
    """The return tuple's items (commas inside brackets kept)."""
    items, depth, cur = [], 0, ""
    for ch in outputs:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return tuple(i for i in items + [cur.strip()] if i)


def shrink(source: str, sabotage: Optional[str] = None, jobs: Optional[int] = None,
           say: Callable[[str], None] = lambda _: None) -> tuple[str, dict]:
    """The smallest wrong case reached from the wrong case ``source``, and its verdict.
    ``sabotage``: run with that sabotaged pass (:data:`.oracle.SABOTAGES`)."""
    case = _Case.parse(source)
    verdict = _run([case.render()], sabotage, jobs)[0]
    if verdict["status"] != "wrong":
        raise ValueError(f"the case is not wrong to begin with: {verdict['status']}")
    while True:
        tries = case.smaller()
        if not tries:
            return case.render(), verdict
        results = _run([t.render() for t in tries], sabotage, jobs)
        wrong = [(t, r) for t, r in zip(tries, results) if r["status"] == "wrong"]
        if not wrong:
            return case.render(), verdict
        case, verdict = min(wrong, key=lambda tr: tr[0].size)
        say(f"shrink: {case.size} lines and outputs, still wrong: {verdict['why'].splitlines()[0]}")


def _run(sources: list[str], sabotage: Optional[str], jobs: Optional[int]) -> list[dict]:
    seeds = [-1 - i for i in range(len(sources))]
    return pair.run(seeds, dict(zip(seeds, sources)), jobs=jobs,
                    sabotage={s: sabotage for s in seeds} if sabotage else None)

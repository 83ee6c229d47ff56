"""The repository speaks to its users: no tracked text refers to how or where it was developed
(machines lent for the work, paths carried to them, a tool's output folder, rounds of work,
issue numbers, a reference checkout outside the repository).

Every file ``git ls-files`` lists (and every untracked file git does not ignore) is read, except
binary files (images, which hold no prose) and this file (it spells the patterns out).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# name -> pattern; each names the development setting it gives away.
PATTERNS: dict[str, re.Pattern[str]] = {
    "lent machines": re.compile(r"\b(lent|withheld)\b", re.I),
    "the development machines": re.compile(
        r"this project's machines|\bmachine kind\b|\bon local disk\b", re.I),
    "carried paths": re.compile(
        r"\bcarried\b|\(carry\b|\bcarry (it|them|this|that|the (build|venv|folder|bundle|path|dir))\b"
        r"|\bcarry=|\bnot_carried\b", re.I),
    "a tool's output folder": re.compile(r"\$\{?OUT\b"),
    "the GPU machine": re.compile(r"\bthe (GPU|CPU|device) machine", re.I),
    # Python APIs such as subprocess's start_new_session are identifiers, not prose.
    # pytest's "test session" is its own scope.
    "sessions": re.compile(r"(?<![\w.])(?<!test )sessions?(?![\w(=])", re.I),
    "issue numbers": re.compile(r"\bissues?[- ]#?\d+|\bissues \d+ and \d+", re.I),
    "round markers": re.compile(
        r"\bv\d{1,2} (session|era|run|code|policy|section|fix|barrier|table|results?)\b"
        # auto_functionalized v1 / v2 are torch's own versions of the op.
        r"|(?<!functionalized's )\(v\d{1,2}\)|Measured, v\d|\bv\d{1,2}-era\b", re.I),
    "a reference checkout": re.compile(r"shared/reference"),
    # Upstream facts cite upstream (a PR, a file in its repository), not a local copy.
    "paths outside the repository": re.compile(r"(?<![\w.\"])/work/|\.venv/lib/"),
}

def tracked_files() -> list[str]:
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"not a git checkout: {out.stderr.strip()}")
        return [line for line in out.stdout.splitlines() if line]

    files = set(git("ls-files")) | set(git("ls-files", "--others", "--exclude-standard"))
    return sorted(f for f in files if (ROOT / f).is_file())


def text_of(path: str) -> str | None:
    data = (ROOT / path).read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def findings() -> dict[tuple[str, str], list[str]]:
    """(path, pattern name) -> the offending lines, as ``line N: text``."""
    me = str(Path(__file__).resolve().relative_to(ROOT))
    out: dict[tuple[str, str], list[str]] = {}
    for path in tracked_files():
        if path == me:
            continue
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for name, pattern in PATTERNS.items():
                if pattern.search(line):
                    out.setdefault((path, name), []).append(f"line {n}: {line.strip()[:160]}")
    return out


def test_no_text_refers_to_how_or_where_it_was_developed() -> None:
    found = findings()
    report = "\n".join(f"{path} ({name}): {line}" for (path, name), lines in sorted(found.items())
                       for line in lines)
    assert not found, "text that refers to the development setting:\n" + report


@pytest.mark.parametrize("line, name", [
    ("no 4- or 8-GPU machine was lent", "lent machines"),
    ("in .flashinfer/ (carry it)", "carried paths"),
    ("which this project's machines have on local disk", "the development machines"),
    ("results under $OUT, or ./out", "a tool's output folder"),
    ("run on the GPU machine: see README", "the GPU machine"),
    ("this session's run", "sessions"),
    ("issue 14's targets", "issue numbers"),
    ("every issue-14 target met", "issue numbers"),
    ("the v10 session", "round markers"),
    ("every 64th poll (v10)", "round markers"),
    ("read from shared/reference/vllm", "a reference checkout"),
    ("see /work/main/.venv/lib/python3.11/site-packages/vllm", "paths outside the repository"),
])
def test_each_pattern_catches_its_example(line: str, name: str) -> None:
    assert PATTERNS[name].search(line)


@pytest.mark.parametrize("line", [
    "subprocess.Popen(cmd, start_new_session=True)",
    "the layers carry those flips on",
    "a dropped carry in the conversion",
    "AITER v0.1.19.post1 and ROCm/aiter#4346",
    "pytorch/pytorch#181086",
    "a silent fallback, equivalent output",
    "OUTDIR defaults to ./out/gpu_check",
    "On a one-GPU machine only the tests marked one_gpu run",
    "compiled once per test session",
    "auto_functionalized's (v1) outputs",
])
def test_patterns_leave_ordinary_text_alone(line: str) -> None:
    assert not [name for name, p in PATTERNS.items() if p.search(line)]

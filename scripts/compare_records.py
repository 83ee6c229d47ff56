"""Compare the pass's decision records of two runs: identical, apart from sites newly fused.

    python scripts/compare_records.py BEFORE AFTER

BEFORE and AFTER are each a directory holding ``fusion_pass_records.rank<r>.jsonl``
files (``FUSION_PASS_RECORD_DIR``, or the ``--out`` directory of ``fusion-pass demo``;
searched recursively, as ``fusion-pass inspect`` does).  Graphs are paired by
rank, token range and identity (a digest of the graph the pass was given), sites
within a graph by position.  Prints every difference and exits 1 if any is
other than a site left unfused before and fused after, or a graph only AFTER has
(a model the run did not have before: its sites are counted as new); exits 0
otherwise (and says how many sites were newly fused).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fusion_pass import records  # noqa: E402

Key = tuple[Any, ...]


def _graphs(path: str) -> list[dict[str, Any]]:
    """Every graph record under ``path``, as plain data."""
    if not os.path.isdir(path):
        raise SystemExit(f"compare_records: {path}: not a directory")
    return [r.to_json() for r in records.read_dir(path)]


def _by_key(graphs: list[dict[str, Any]]) -> dict[Key, list[list[dict[str, Any]]]]:
    """Per (rank, token range, identity): the site lists of the graphs with it, in order."""
    out: dict[Key, list[list[dict[str, Any]]]] = defaultdict(list)
    for g in graphs:
        out[(g["rank"], g["token_range"], g["uuid"])].append(
            [{k: str(v) if k == "path" else v for k, v in s.items()} for s in g["sites"]])
    return out


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> tuple[list[str], int]:
    """``(differences other than new fusions, sites newly fused)``."""
    a, b = _by_key(before), _by_key(after)
    problems, newly = [], 0
    for key in sorted(set(a) | set(b), key=repr):
        if key not in a:  # a graph of a model the earlier run did not compile
            newly += sum(s["path"] != "unfused" for sites in b[key] for s in sites)
            continue
        if len(a.get(key, [])) != len(b.get(key, [])):
            problems.append(f"{key}: {len(a.get(key, []))} graph(s) before, "
                            f"{len(b.get(key, []))} after")
            continue
        for sites_a, sites_b in zip(a[key], b[key]):
            if len(sites_a) != len(sites_b):
                problems.append(f"{key}: {len(sites_a)} site(s) before, {len(sites_b)} after")
                continue
            for i, (sa, sb) in enumerate(zip(sites_a, sites_b)):
                if sa == sb:
                    continue
                if sa["path"] == "unfused" and sb["path"] != "unfused":
                    newly += 1
                    continue
                changed = {k: (sa.get(k), sb.get(k)) for k in set(sa) | set(sb)
                           if sa.get(k) != sb.get(k)}
                problems.append(f"{key} site {i}: {changed}")
    return problems, newly


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = (_graphs(p) for p in argv)
    problems, newly = compare(before, after)
    paths = Counter(str(s["path"]) for g in after for s in g["sites"])
    print(f"before: {len(before)} graph(s); after: {len(after)} graph(s), sites by path "
          f"{dict(sorted(paths.items()))}; newly fused: {newly}")
    for p in problems:
        print(f"differs: {p}")
    print("identical apart from new fusions" if not problems else
          f"{len(problems)} difference(s) other than new fusions")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

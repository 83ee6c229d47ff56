"""Measured token schedules of a backend, read from a committed table.

``fusion_pass/data/<backend>_schedule.json`` is written by
``benchmarks/op/crossover.py`` from a ``bench_op.py`` result (its ``one_stage`` and
``two_stage`` columns): for each (dtype, world size, hidden) it measured, the token
counts at which the faster kernel changes.  The gate reads it through the
backend's :class:`~fusion_pass.gate.BackendLimits` (``schedules``) wherever the
caller forces no threshold; a missing file means AITER's 80-token rule.

File format::

    {"source": "...", "schedules": [
        {"dtype": "bfloat16", "world_size": 2, "hidden": 2880,
         "steps": [[96, "one_stage"], [768, "two_stage"], [null, "one_stage"]]}, ...]}
"""

from __future__ import annotations

import json
from pathlib import Path as FsPath

from .gate import Path, Schedule

DATA_DIR = FsPath(__file__).parent / "data"


def path_of(backend: str) -> FsPath:
    return DATA_DIR / f"{backend}_schedule.json"


def parse(table: dict) -> tuple[Schedule, ...]:
    """Schedules from a table's JSON (raises ValueError on a malformed one)."""
    out = []
    for entry in table.get("schedules", []):
        steps = tuple((None if up is None else int(up), Path(p)) for up, p in entry["steps"])
        out.append(Schedule(dtype=str(entry["dtype"]), world_size=int(entry["world_size"]),
                            hidden=int(entry["hidden"]), steps=steps))
    return tuple(out)


def load(backend: str) -> tuple[Schedule, ...]:
    """The committed schedules of ``backend``; none when it has no table."""
    path = path_of(backend)
    if not path.is_file():
        return ()
    return parse(json.loads(path.read_text()))

"""The crossover rule (benchmarks/op/crossover.py) on synthetic bench rows, its table as the
gate reads it, its CLI, and the installation bench_op.py does before its final phase."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

# The op benchmark's modules, and the ones the benchmarks share (bench_common.py).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "op"), str(BENCHMARKS)]
import crossover  # noqa: E402

from fusion_pass import gate, schedules  # noqa: E402

NAN = float("nan")


def rows(hidden: int, points: list[tuple[int, Optional[float], Optional[float]]]
         ) -> list[dict[str, Any]]:
    """Bench rows; None leaves a column out (the path was not measured)."""
    out = []
    for tokens, one, two in points:
        r: dict[str, Any] = {"hidden": hidden, "tokens": tokens, "fused": 1.0, "nccl": 9.0}
        if one is not None:
            r["one_stage"] = one
        if two is not None:
            r["two_stage"] = two
        out.append(r)
    return out


# One-stage ahead to 80, two-stage from 128 to 512, one-stage again from 1024.
POINTS = [(1, 3.6, 5.1), (8, 3.7, 5.2), (80, 4.9, 6.0), (128, 8.0, 7.1), (512, 20.0, 14.0),
          (1024, 30.0, 33.0), (2048, 60.0, 66.0)]


def schedule_of(tab: dict[str, Any], hidden: int) -> list[list[Any]]:
    return next(s["steps"] for s in tab["schedules"] if s["hidden"] == hidden)


def test_runs_are_cut_at_their_last_measured_count() -> None:
    tab = crossover.table(rows(4096, POINTS), "bfloat16", 2, "test")
    assert schedule_of(tab, 4096) == [[80, "one_stage"], [512, "two_stage"], [None, "one_stage"]]


def test_differences_within_noise_keep_the_previous_path() -> None:
    # 128: two-stage 2 % faster (noise: stays one-stage); 256: 10 % faster (switches);
    # 512: one-stage 1 % faster (stays two-stage).
    pts = [(1, 3.0, 5.0), (128, 8.0, 7.85), (256, 11.0, 10.0), (512, 14.0, 14.14)]
    tab = crossover.table(rows(2880, pts), "bfloat16", 2, "test")
    assert schedule_of(tab, 2880) == [[128, "one_stage"], [None, "two_stage"]]
    # A larger noise band keeps one-stage through the 10 % difference too.
    tab = crossover.table(rows(2880, pts), "bfloat16", 2, "test", noise=0.15)
    assert schedule_of(tab, 2880) == [[None, "one_stage"]]
    # The first count has no previous path: a tie there is one-stage.
    assert crossover.choose([(1, 5.0, 4.95), (8, 6.0, 5.0)]) == [(1, "one_stage"), (8, "two_stage")]


def test_counts_with_one_path_and_rows_without_one_stage() -> None:
    pts = [(1, 3.0, 5.0), (64, NAN, 6.0), (128, None, 7.0), (256, 9.0, 12.0)]
    tab = crossover.table(rows(8192, pts) + rows(12288, [(1, None, 6.0), (8, None, 6.5)]),
                          "bfloat16", 2, "test")
    assert schedule_of(tab, 8192) == [[1, "one_stage"], [128, "two_stage"], [None, "one_stage"]]
    # One-stage never measured (the row does not fit one block): no schedule at all.
    assert [s["hidden"] for s in tab["schedules"]] == [8192]
    assert crossover.table([], "bfloat16", 2, "test")["schedules"] == []


def test_the_gate_takes_the_measured_path_at_every_count() -> None:
    tab = crossover.table(rows(4096, POINTS) + rows(8192, [(1, 4.0, 5.0), (2048, 90.0, 80.0)]),
                          "bfloat16", 2, "test")
    limits = gate.BackendLimits(name="t", schedules=schedules.parse(json.loads(json.dumps(tab))))
    best = {t: ("one_stage" if o < w else "two_stage") for t, o, w in POINTS}
    for tokens, path in best.items():
        assert gate.decide(4096, "bfloat16", 2, tokens, limits=limits).path.value == path
    # Between measured counts the upper run's path; 5120 takes the nearest (4096) schedule.
    assert gate.decide(4096, "bfloat16", 2, 81, limits=limits).path.value == "two_stage"
    assert gate.decide(5120, "bfloat16", 2, 600, limits=limits).path.value == "one_stage"
    # A forced threshold still overrides the table; another world size ignores it.
    assert gate.decide(4096, "bfloat16", 2, 600, limits=limits, threshold=80).path.value == "two_stage"
    assert gate.decide(4096, "bfloat16", 4, 600, limits=limits).path.value == "two_stage"


def test_cli_writes_the_table_of_a_result_file(tmp_path: Path) -> None:
    result = {"meta": {"dtype": "bfloat16", "world_size": 2, "device": "NVIDIA H200",
                       "date": "2026-11-30 12:00:00"},
              "rows": rows(4096, POINTS)}
    src = tmp_path / "op_h200x2.json"
    src.write_text(json.dumps(result))
    out = tmp_path / "data" / "triton_schedule.json"
    assert crossover.main([str(src), "--out", str(out)]) == 0
    tab = json.loads(out.read_text())
    assert "op_h200x2.json" in tab["source"] and tab["noise"] == crossover.NOISE
    (sched,) = schedules.parse(tab)
    assert (sched.dtype, sched.world_size, sched.hidden) == ("bfloat16", 2, 4096)
    assert sched.steps == ((80, gate.Path.ONE_STAGE), (512, gate.Path.TWO_STAGE),
                           (None, gate.Path.ONE_STAGE))
    assert schedule_of(tab, 4096)[0] == [80, "one_stage"]
    assert tab["schedules"][0]["measured"][0] == [1, 3.6, 5.1]


def test_bench_op_runs_its_table_without_writing_package_state() -> None:
    pytest.importorskip("torch")
    import bench_op

    from fusion_pass import backends
    from fusion_pass.backends import triton_symm

    committed = triton_symm.LIMITS
    try:
        limits = bench_op.select_measured(crossover.table(rows(4096, POINTS), "bfloat16", 2,
                                                            "test"))
        assert backends.select("cuda").limits is limits
        # The package's own backend and its committed schedule are untouched.
        assert triton_symm.LIMITS is committed and backends.get("triton").limits is committed
        assert limits.max_bytes is None  # no size limit: larger calls run in row pieces
        assert limits.steps_for(4096, "bfloat16", 2)[0] == (80, gate.Path.ONE_STAGE)
        # What the op asks per call (path "auto") with a 1024-token input.
        torch = pytest.importorskip("torch")
        decision = gate.decide(4096, torch.bfloat16, 2, 1024, limits=backends.select("cuda").limits)
        assert decision.path is gate.Path.ONE_STAGE and "measured schedule" in decision.reason
    finally:
        backends.set_backend(None)

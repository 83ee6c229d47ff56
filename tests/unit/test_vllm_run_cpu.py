"""A benchmark stopped by its time limit stops its engines first: SIGTERM inside
``vllm_run.execute`` runs its stop, and the handler is gone afterwards."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _run(measure, tmp_path):
    import vllm_run

    stopped = []
    run = SimpleNamespace(deadline=time.monotonic() + 60, started=time.monotonic(),
                          root=tmp_path)
    args = SimpleNamespace(tp=1, check="none", start_parallel=0, start_timeout_s=10,
                           work_dir=tmp_path)
    result = {"models": [], "settings": {"check": "none"}}
    rc = vllm_run.execute(run, args, result, tmp_path / "r.json", {"m": ["engine"]},
                          lambda *a: None, measure, stopped.extend, 0.5, None, "offline",
                          ("tpot",), lambda r: [])
    return rc, stopped


def test_sigterm_stops_the_engines_and_exits(tmp_path) -> None:
    def measure(units, deadline, clocks):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives before this ends
        raise AssertionError("SIGTERM did not stop the measurement")

    stopped: list = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        try:
            _run(measure, tmp_path)
        finally:
            stopped.append(signal.getsignal(signal.SIGTERM))
    assert e.value.code == 128 + signal.SIGTERM
    assert stopped == [before], "the handler outlived the run"


def test_a_finished_run_leaves_sigterm_as_it_was(tmp_path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    rc, stopped = _run(lambda units, deadline, clocks: {"model": {"name": "m"}, "aa": {}},
                       tmp_path)
    assert stopped == ["engine"] and signal.getsignal(signal.SIGTERM) == before

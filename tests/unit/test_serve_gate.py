"""benchmarks/vllm/serve_gate.py without vLLM: the gate against a stand-in server that answers
vLLM's ``/pause``, ``/resume`` and ``/load`` as vLLM 0.26-0.34 do (``{"status": ...}``,
``{"server_load": n}``), driven by a stand-in of ``vllm bench serve``'s ``benchmark`` that
makes its requests from the module's ``get_request`` as vLLM's does; and the times counted
from the release on a made-up result.  The real server and client: tests/e2e/
test_bench_serve_cpu.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "vllm"))

import serve_gate  # noqa: E402


class _Server(http.server.ThreadingHTTPServer):
    paused = False
    load = 0
    fail_resume = False
    fail_load = False
    calls: list[str]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.server.calls.append(self.path)
        if self.path.startswith("/pause"):
            assert "mode=keep" in self.path
            self.server.paused = True
            self._answer(200, {"status": "paused"})
        elif self.path == "/resume":
            if self.server.fail_resume:
                self._answer(500, {"error": "Failed to resume generation"})
                return
            self.server.paused = False
            self._answer(200, {"status": "resumed"})
        elif self.path == "/enter":  # the stand-in's request entering the server
            self.server.load += 1
            self._answer(200, {})

    def do_GET(self) -> None:  # noqa: N802
        assert self.path == "/load"
        if self.server.fail_load and self.server.paused:
            self._answer(500, {"error": "no count"})
            return
        self._answer(200, {"server_load": self.server.load})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.calls = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def _standin(url: str, n: int, log: list[tuple[str, float]]) -> types.ModuleType:
    """A module shaped like ``vllm.benchmarks.serve``: ``benchmark`` looks up ``get_request``
    when it runs, makes a task per request (each enters the server, then waits until the
    server is not paused: its first token) and gathers them."""
    mod = types.ModuleType("serve_standin")

    async def get_request(requests):
        for r in requests:
            yield r, float("inf")

    async def one(i: int) -> None:
        await asyncio.to_thread(serve_gate._call, f"{url}/enter", "POST")
        log.append(("entered", time.perf_counter()))
        while True:
            paused = await asyncio.to_thread(lambda: srv_state["server"].paused)
            if not paused:
                break
            await asyncio.sleep(0.001)
        log.append(("first token", time.perf_counter()))

    srv_state: dict = {}

    async def benchmark():
        tasks = []
        async for _request, _rate in mod.get_request(list(range(n))):
            tasks.append(asyncio.create_task(one(_request)))
        await asyncio.gather(*tasks)

    mod.get_request = get_request
    mod.main = lambda: asyncio.run(benchmark())
    mod.state = srv_state
    return mod


def test_the_wave_is_released_only_once_all_of_it_is_in_the_server(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # Two requests of an earlier run still counted (their handlers not yet ended): the
    # wave is the count above them.
    server.load = 2
    log: list[tuple[str, float]] = []
    mod = _standin(url, 5, log)
    mod.state["server"] = server
    original = mod.get_request
    with serve_gate.gated(mod, url, expected=5) as hold:
        assert mod.get_request is not original
        mod.main()
    assert mod.get_request is original
    assert hold.base == 2 and hold.queued == 5 and hold.error is None and hold.hold_s > 0
    entered = [t for what, t in log if what == "entered"]
    first = [t for what, t in log if what == "first token"]
    assert len(entered) == len(first) == 5
    # Every request entered before the release, every first token came after it.
    assert max(entered) <= hold.released_at <= min(first)
    assert server.calls[0].startswith("/pause") and server.calls[-1] == "/resume"
    assert not server.paused


def test_a_release_that_fails_cancels_the_run_instead_of_leaving_it_waiting(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.fail_resume = True
    mod = _standin(url, 3, [])
    mod.state["server"] = server
    t0 = time.monotonic()
    # An Exception (the benchmark records the run as failed and goes on), not asyncio's
    # cancellation, which would end the whole benchmark.
    with pytest.raises(serve_gate.ReleaseFailed, match="500"):
        serve_gate.run(mod, url, 3, mod.main)
    assert time.monotonic() - t0 < 5
    # The way out tried to resume the server once more.
    assert server.calls.count("/resume") == 2


def test_a_count_that_cannot_be_read_releases_the_wave_at_once_and_says_so(server):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.fail_load = True
    mod = _standin(url, 3, [])
    mod.state["server"] = server
    result, hold = serve_gate.run(mod, url, 3, lambda: (mod.main(), {"ran": True})[1])
    assert result == {"ran": True} and not server.paused
    assert "count" in hold.error and "500" in hold.error and hold.released_at is not None


def test_a_wave_that_never_fills_is_released_at_the_timeout_and_says_so(server, monkeypatch):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(serve_gate, "TIMEOUT_S", 0.3)
    mod = _standin(url, 2, [])
    mod.state["server"] = server
    with serve_gate.gated(mod, url, expected=3) as hold:
        mod.main()
    assert hold.queued == 2 and hold.expected == 3 and hold.hold_s >= 0.3


def test_times_to_first_token_and_rates_count_from_the_release():
    # Two requests sent at t=10.0 and 10.1, released at 10.5: first tokens at 10.6 and 10.8,
    # then 3 tokens 0.01 s apart (4 tokens each), so they end at 10.63 and 10.83.
    r = {"start_times": [10.0, 10.1], "ttfts": [0.6, 0.7], "itls": [[0.01] * 3, [0.01] * 3],
         "output_lens": [4, 4], "total_input_tokens": 20, "duration": 0.9,
         "output_throughput": 8 / 0.9, "median_ttft_ms": 650.0, "median_tpot_ms": 10.0}
    hold = serve_gate.Hold(expected=2, queued=2, hold_s=0.4, released_at=10.5)
    out = serve_gate.from_release(r, hold)
    assert out["duration"] == pytest.approx(0.33)
    assert out["output_throughput"] == pytest.approx(8 / 0.33)
    assert out["total_token_throughput"] == pytest.approx(28 / 0.33)
    assert out["request_throughput"] == pytest.approx(2 / 0.33)
    assert out["median_ttft_ms"] == pytest.approx(200.0)
    # numpy's linear percentile of [100, 300] at 99: 100 + 0.99 * 200.
    assert out["p99_ttft_ms"] == pytest.approx(298.0)
    assert out["median_e2el_ms"] == pytest.approx(230.0)
    assert out["first_tokens_before_release"] == 0
    # Each request's, in the run's order: first tokens 0.1 and 0.3 s after the release, then
    # 3 tokens 10 ms apart.
    assert out["ttft_ms_each"] == [pytest.approx(100.0), pytest.approx(300.0)]
    assert out["tpot_ms_each"] == [pytest.approx(10.0), pytest.approx(10.0)]
    # TPOT starts at the first token: vLLM's own; its own figures kept under with_hold.
    assert out["median_tpot_ms"] == 10.0
    assert out["with_hold"]["output_throughput"] == pytest.approx(8 / 0.9)
    assert out["with_hold"]["median_ttft_ms"] == 650.0
    # A token before the release is counted (a pause that did not hold).
    early = serve_gate.from_release(
        r, serve_gate.Hold(expected=2, queued=2, hold_s=0.6, released_at=10.65))
    assert early["first_tokens_before_release"] == 1


def test_requests_beyond_the_first_wave_count_from_their_own_send_failed_ones_not_at_all():
    # Released at 10.5; request 0 sent at 10.0 (held), request 1 sent at 11.0 as a slot
    # freed (after the release), request 2 failed (no output tokens).
    r = {"start_times": [10.0, 11.0, 10.0], "ttfts": [0.6, 0.05, 0.7],
         "itls": [[0.01], [0.01], []], "output_lens": [2, 2, 0], "total_input_tokens": 30}
    out = serve_gate.from_release(
        r, serve_gate.Hold(expected=2, queued=2, hold_s=0.4, released_at=10.5))
    assert out["ttft_ms_each"] == [pytest.approx(100.0), pytest.approx(50.0)]
    assert out["median_e2el_ms"] == pytest.approx((110.0 + 60.0) / 2)
    assert out["request_throughput"] == pytest.approx(2 / (11.06 - 10.5))
    assert out["output_throughput"] == pytest.approx(4 / (11.06 - 10.5))


def test_a_run_never_released_is_left_as_vllm_reported_it():
    r = {"start_times": [1.0], "ttfts": [0.5], "itls": [[0.1]], "output_lens": [2],
         "output_throughput": 3.0}
    assert serve_gate.from_release(r, serve_gate.Hold(expected=1)) is r

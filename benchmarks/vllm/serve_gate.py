"""Gated arrival for ``vllm bench serve`` (``bench_serve.py --arrival gated``, the default):
a run's requests are held at the server until every one of its first wave is inside, then
released together, so that vLLM's scheduler sees the whole wave at its first step.

Why: sent at once (``--request-rate inf``), a wave's requests reach the scheduler over a few
milliseconds, and its first step starts with whichever are in.  With one prompt in it
instead of two, every later prefill moves by a step, and the median request's count of
prefill steps inside its decode, and with it median TPOT, takes one of two values a few
per cent apart from run to run (docs/vllm_benchmark.md, section 9).  Held until all are
queued, the first step always has the same prompts and the steps after it follow.

How, with vLLM's own endpoints:

- ``POST /pause?mode=keep`` freezes the scheduler: requests still enter its queue, no step
  runs (``PauseState.PAUSED_ALL``); ``POST /resume`` lets it go.  Both are vLLM's
  development endpoints (``VLLM_SERVER_DEV_MODE=1``: :data:`SERVER_ENV`), which vLLM's own
  ``vllm bench sweep`` turns on for the servers it benchmarks.
- ``GET /load`` counts the requests inside the server's handlers
  (``--enable-server-load-tracking``: :data:`SERVER_ARGS`).  A streamed completion is
  counted as its handler starts, before its prompt is tokenized; it reaches the engine
  as its response starts, which :func:`margin_s` allows for.

The wait is not timed as a request's: time to first token, end-to-end latency and the
rates are counted from the release (:func:`from_release`); TPOT and ITL, which start at a
request's first token, are vLLM's own.  ``vllm bench serve``'s own figures, which count
from each request's send and so include the hold, are kept beside them (``with_hold``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import time
import urllib.request
from typing import Any, Callable, Iterator, Optional

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SERVER_ARGS = ["--enable-server-load-tracking"]

POLL_S = 0.005
"""Between two reads of the server's count while holding."""
MARGIN_S = 0.02
PER_REQUEST_S = 0.002
TIMEOUT_S = 10.0
"""The longest hold: released then whatever the count (the run records how many were in)."""
HTTP_TIMEOUT_S = 10.0


def margin_s(expected: int) -> float:
    """After the count is complete, before the release: the wave's way from the handlers
    into the engine core's queue.  The count goes up as each handler starts, before its
    prompt is tokenized, so the last requests of a wave may still be queued for the
    tokenizer: ``PER_REQUEST_S`` a request (a 1000-token prompt takes about a millisecond
    to tokenize) on top of ``MARGIN_S`` for the hand-over to the engine core."""
    return MARGIN_S + PER_REQUEST_S * expected


@dataclasses.dataclass
class Hold:
    """One gated run: how many requests were expected in the first wave, the server's count
    before the pause (``base``: requests of earlier runs whose handlers had not yet ended)
    and at the release (``queued``, the run's own), how long the wave was held (from the
    moment the run's last request was made) and when it was released
    (``time.perf_counter()``, the clock ``vllm bench serve`` stamps requests with: the same
    process)."""

    expected: int
    base: Optional[int] = None
    queued: Optional[int] = None
    hold_s: Optional[float] = None
    released_at: Optional[float] = None
    paused: bool = False
    error: Optional[str] = None

    def record(self) -> dict[str, Any]:
        return {"expected": self.expected, "base": self.base, "queued": self.queued,
                "hold_s": None if self.hold_s is None else round(self.hold_s, 4),
                **({"error": self.error} if self.error else {})}


def _call(url: str, method: str = "GET") -> dict[str, Any]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
        return json.loads(r.read() or b"{}")


def pause(base_url: str) -> None:
    # clear_cache=false: vLLM would otherwise reset the prefix cache as it pauses; the run
    # finds the server as it would without the gate.
    _call(f"{base_url}/pause?mode=keep&clear_cache=false", "POST")


def resume(base_url: str) -> None:
    _call(f"{base_url}/resume", "POST")


def load(base_url: str) -> int:
    return int(_call(f"{base_url}/load")["server_load"])


class ReleaseFailed(RuntimeError):
    """The server could not be resumed: the run was cancelled rather than left waiting."""


@contextlib.contextmanager
def gated(serve: Any, base_url: str, expected: int) -> Iterator[Hold]:
    """While this is open, ``vllm bench serve`` runs (module ``serve``,
    ``vllm.benchmarks.serve``, called in this process) against ``base_url`` are gated: the
    server is paused as the run's requests are made (after its ready check and warm-ups, if
    any), and released once ``expected`` of them are inside it, at most :data:`TIMEOUT_S`
    of polling later.

    The run's requests come from ``serve.get_request``, an async generator that ``benchmark``
    looks up when it runs; it is wrapped here and restored on the way out.  A count that
    cannot be read releases the wave at once (the error recorded); a release that fails
    cancels the run rather than leave it waiting on a paused server (:func:`run`, which
    raises :class:`ReleaseFailed` then); and the server is resumed on the way out whatever
    happened."""
    hold = Hold(expected)
    original = serve.get_request
    pending: list[asyncio.Task] = []

    async def release(run: Optional[asyncio.Task]) -> None:
        t0 = time.perf_counter()
        want = (hold.base or 0) + expected
        n = 0
        try:
            while time.perf_counter() - t0 < TIMEOUT_S:
                n = await asyncio.to_thread(load, base_url)
                if n >= want:
                    break
                await asyncio.sleep(POLL_S)
            await asyncio.sleep(margin_s(expected))
        except Exception as exc:  # noqa: BLE001 - released at once, the error recorded
            hold.error = f"the server's count: {type(exc).__name__}: {exc}"
        hold.queued = n - (hold.base or 0)
        hold.released_at = time.perf_counter()
        hold.hold_s = hold.released_at - t0
        try:
            await asyncio.to_thread(resume, base_url)
            hold.paused = False
        except Exception as exc:  # noqa: BLE001 - the run must not wait on a paused server
            hold.error = f"the release: {type(exc).__name__}: {exc}"
            if run is not None:
                run.cancel()

    async def get_request(*args: Any, **kwargs: Any):
        hold.base = await asyncio.to_thread(load, base_url)
        # Marked first: a pause whose answer is lost is still resumed on the way out.
        hold.paused = True
        await asyncio.to_thread(pause, base_url)
        async for item in original(*args, **kwargs):
            yield item
        # Every request of the run is made (its task not yet started): release them once
        # the server has the first wave.
        pending.append(asyncio.get_running_loop().create_task(
            release(asyncio.current_task())))

    serve.get_request = get_request
    try:
        yield hold
    finally:
        serve.get_request = original
        if hold.paused:
            with contextlib.suppress(Exception):
                resume(base_url)
            hold.paused = False


def run(serve: Any, base_url: str, expected: int,
        main: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Hold]:
    """``main()`` (one ``vllm bench serve`` run) gated (:func:`gated`); a run cancelled
    because its release failed raises :class:`ReleaseFailed` (an ``Exception``, which the
    benchmark records as that run's failure, where ``asyncio``'s cancellation would end the
    whole benchmark)."""
    with gated(serve, base_url, expected) as hold:
        try:
            result = main()
        except asyncio.CancelledError:
            if hold.error:
                raise ReleaseFailed(hold.error) from None
            raise
    return result, hold


def _percentile(xs: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as ``vllm bench serve`` computes them."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def from_release(result: dict[str, Any], hold: Hold) -> dict[str, Any]:
    """``result`` (``vllm bench serve``'s, with ``--save-detailed``) with each request's time
    to first token and end-to-end latency counted from the release, or from its own send
    where that came later (a request beyond the first wave, sent as a slot freed), and the
    rates over the time from the release to the last token; its own values under
    ``with_hold``; ``first_tokens_before_release``: how many requests had a token before the
    release (0 where the pause held); each request's time to first token so counted and its
    time per output token, in the order the run made them (``ttft_ms_each``,
    ``tpot_ms_each``: how a run shared its prefill steps out).  Requests that failed (no
    output tokens) are left out, as ``vllm bench serve`` leaves them out of its own.
    Unchanged where the run was not released or has no per-request times."""
    starts, ttfts, itls = (result.get(k) or [] for k in ("start_times", "ttfts", "itls"))
    outs = result.get("output_lens") or []
    t = hold.released_at
    done = [i for i, x in enumerate(ttfts)
            if x and i < len(starts) and i < len(itls) and i < len(outs) and outs[i] > 0]
    if t is None or not done:
        return result
    origin = [max(starts[i], t) for i in done]
    first = [starts[i] + ttfts[i] for i in done]
    end = [starts[i] + ttfts[i] + sum(itls[i]) for i in done]
    window = max(end) - t
    out = dict(result)
    keys = ("duration", "request_throughput", "output_throughput", "total_token_throughput",
            "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "mean_e2el_ms", "median_e2el_ms",
            "p99_e2el_ms")
    out["with_hold"] = {k: result.get(k) for k in keys}
    ttft_ms = [(x - o) * 1000.0 for x, o in zip(first, origin)]
    e2el_ms = [(x - o) * 1000.0 for x, o in zip(end, origin)]
    tokens = sum(outs[i] for i in done)
    out.update({
        "duration": window,
        "request_throughput": len(done) / window,
        "output_throughput": tokens / window,
        "total_token_throughput": (result.get("total_input_tokens", 0) + tokens) / window,
        "mean_ttft_ms": statistics.fmean(ttft_ms), "median_ttft_ms": statistics.median(ttft_ms),
        "p99_ttft_ms": _percentile(ttft_ms, 99), "mean_e2el_ms": statistics.fmean(e2el_ms),
        "median_e2el_ms": statistics.median(e2el_ms), "p99_e2el_ms": _percentile(e2el_ms, 99),
        "first_tokens_before_release": sum(x <= t for x in first),
        "ttft_ms_each": [round(x, 2) for x in ttft_ms],
        "tpot_ms_each": [round(1000.0 * sum(itls[i]) / (outs[i] - 1), 3) if outs[i] > 1
                         else None for i in done]})
    return out

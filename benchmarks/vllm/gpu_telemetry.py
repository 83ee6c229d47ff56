"""The GPUs' clocks while the benchmark measures: NVML, sampled in a thread.

NVML needs no CUDA context, so the benchmark's own process (which runs no kernel) can
watch the GPUs its engines use.  Per timed call: the mean SM clock over the samples
taken during it and the clock-event reasons seen (power cap, thermal slowdown...); per
engine turn: clocks, temperature and power before and after.  Without NVML (the CPU)
every reading is None and the reason is recorded.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Optional

REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
           0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
           0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
           0x100: "display_clock_setting"}


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


class ClockSampler:
    """``start()``/``stop()`` a sampling thread; ``window(t0, t1)`` summarises the samples
    taken between two ``time.monotonic()`` readings; ``snapshot()`` reads every GPU once."""

    def __init__(self, count: int, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.handles: list[Any] = []
        self.unavailable: Optional[str] = None
        self._samples: list[tuple[float, list[int], int]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _indices(count)]
            self._reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        except Exception as exc:  # noqa: BLE001 - no NVML, no GPU: say why
            self.unavailable = f"{type(exc).__name__}: {exc}"
            self.handles = []

    def describe(self) -> str:
        return self.unavailable or f"NVML, every {self.period_s} s"

    def _sample(self) -> tuple[float, list[int], int]:
        sm = [self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_SM) for h in self.handles]
        mask = 0
        for h in self.handles:
            mask |= int(self._reasons(h))
        return time.monotonic(), sm, mask

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._samples.append(self._sample())
            except Exception:  # noqa: BLE001 - a failed reading is a missing sample
                continue

    def start(self) -> None:
        if self.handles and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def window(self, t0: float, t1: float) -> Optional[dict[str, Any]]:
        inside = [s for s in self._samples if t0 <= s[0] <= t1]
        if not self.handles:
            return None
        mask = 0
        for s in inside:
            mask |= s[2]
        return {"sm_mhz": statistics.fmean(statistics.fmean(s[1]) for s in inside)
                if inside else None, "samples": len(inside), "reasons": reason_names(mask)}

    def snapshot(self) -> Optional[list[dict[str, Any]]]:
        """Per GPU: SM and memory clocks (MHz), temperature (C), power (W), reasons."""
        if not self.handles:
            return None
        nv, out = self.nvml, []
        for h in self.handles:
            try:
                out.append({"sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                            "mem_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                            "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                            "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                            "reasons": reason_names(int(self._reasons(h)))})
            except Exception as exc:  # noqa: BLE001
                out.append({"error": f"{type(exc).__name__}: {exc}"})
        return out


def _indices(count: int) -> list[int]:
    """The NVML indices of the first ``count`` GPUs CUDA sees (CUDA_VISIBLE_DEVICES as
    indices; anything else, e.g. UUIDs, is read as the first ``count``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        return [int(p) for p in parts[:count]]
    return list(range(count))

"""Timing on the current device: warm-up, repeats, median, within a time budget.

CUDA kernels are timed with CUDA events around each call (device time, no host jitter); CPU ops with
`time.perf_counter`. The median of the repeats is reported: on a shared machine the mean is pulled up
by whatever else runs, the median much less.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MIN_REPEATS = 3
MAX_REPEATS = 25
WARMUP_CALLS = 2


@dataclass
class Deadline:
    """A share of the profile's time budget; measurements stop asking for time once it has passed."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left_s(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def split(self, share: float) -> Deadline:
        """A sub-deadline of `share` of the time left."""
        return Deadline(max(self.left_s(), 0.0) * share)


@dataclass(frozen=True)
class Timer:
    """Times a callable on `device` ("cuda" or "cpu")."""

    device: str

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def once_s(self, fn: Callable[[], object]) -> float:
        """Seconds for one call of `fn`, everything it launched included."""
        if self.device == "cuda":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def median_s(self, fn: Callable[[], object], budget_s: float) -> tuple[float, int]:
        """(median seconds per call, repeats): warm-up calls, then at least MIN_REPEATS timed calls and
        more while `budget_s` lasts (at most MAX_REPEATS). A call slower than the whole budget is timed
        once after a single warm-up, so one huge shape cannot eat the profile."""
        started = time.perf_counter()
        first = self.once_s(fn)  # warm-up (allocator, kernel selection, oneDNN primitive cache)
        self.sync()
        if first > budget_s:
            return self.once_s(fn), 1
        for _ in range(WARMUP_CALLS - 1):
            self.once_s(fn)
        times: list[float] = []
        while len(times) < MAX_REPEATS:
            times.append(self.once_s(fn))
            if len(times) >= MIN_REPEATS and time.perf_counter() - started > budget_s:
                break
        return statistics.median(times), len(times)

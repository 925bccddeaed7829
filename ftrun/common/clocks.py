"""A clock that counts only the time its process ran: the judge of silence.

The coordinator declares a rank hung after ``--heartbeat_timeout`` seconds without a heartbeat, and a
node lost after the silence timeout; a node's agent declares the coordinator lost the same way. A
judge that was itself stopped (SIGSTOP, a host swapping, a descheduled VM) for longer than the
timeout wakes to find every peer silent: the heartbeats sent meanwhile are still in its sockets. On
plain ``time.monotonic()`` it would then kill healthy ranks. On a :class:`RunningClock` the time it
did not run is not counted, so every peer gets a fresh window, and a peer that is really silent is
judged once the judge has listened for the whole timeout.
"""

from __future__ import annotations

import time
from typing import Callable

MIN_GAP_S = 1.0  # a gap this long between two readings is the process's own stall, whatever its loop's period


class RunningClock:
    """Monotonic seconds, less the process's own stalls.

    A gap longer than ``max_gap`` seconds between two readings is a stall of the process (its loop
    reads the clock at every turn, so a long gap means it did not run): it counts as ``max_gap``
    seconds. The clock never goes backwards.

    Args:
        max_gap: the longest gap between two readings taken as running, seconds (more than the
            loop's period: its poll timeout plus its work).
        source: the underlying monotonic clock, seconds (injected by tests).

    Attributes:
        stalled: total seconds not counted.
        last_stall: the length of the most recent stall (its whole gap, seconds), 0.0 before any.
    """

    def __init__(self, max_gap: float, source: Callable[[], float] = time.monotonic) -> None:
        if max_gap <= 0:
            raise ValueError(f"max_gap must be positive, got {max_gap!r}")
        self.max_gap, self._source = max_gap, source
        self._last = source()
        self.stalled = 0.0
        self.last_stall = 0.0

    @classmethod
    def for_loop(cls, period: float, source: Callable[[], float] = time.monotonic) -> "RunningClock":
        """A clock for a loop that wakes at least every ``period`` seconds: gaps up to three
        periods (and at least :data:`MIN_GAP_S`) are running time."""
        return cls(max(MIN_GAP_S, 3 * period), source)

    def __call__(self) -> float:
        now = self._source()
        gap = now - self._last
        if gap > self.max_gap:
            self.stalled += gap - self.max_gap
            self.last_stall = gap
        self._last = now
        return now - self.stalled

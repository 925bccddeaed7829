"""The coordinator's use of Python's cyclic garbage collector at thousands of ranks.

Its rank table is long-lived and large (a million objects at 16,384 ranks): outside a recovery
round it is moved out of the collector's sight now and then (``gc.freeze``), and in a round's first
seconds the collector waits (``gc.disable``), so that no collection runs in the path every rank of
the round waits on. Refcounting frees what the coordinator drops either way; only a cycle among
frozen objects would outlive them (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

#: Outside a recovery round, the objects the coordinator holds are moved out of the cyclic garbage
#: collector's sight (``gc.freeze``) 1, 2, 4... s after the start, then this often, seconds: its
#: rank table is long-lived, and each full collection walked all of it (at 16,384 ranks, 1.6 to
#: 3.4% of a core in steady state).
GC_FREEZE_S = 60.0

#: In a recovery round's first this many seconds the collector waits: the round's 32,768 answers at
#: 16,384 ranks set off collections of the objects not frozen yet, two or three full ones among
#: them (6 to 15 ms each). It runs again when the round ends or this time is past, however long the
#: round (one that awaits a replacement node).
ROUND_GC_HOLD_S = 2.0


class Collector:
    """When the coordinator ``job`` freezes its objects and holds the collector.

    Only while its main loop runs (:meth:`armed`): a coordinator driven without it, in a test,
    leaves the collector be.
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.looping = False
        self.held = False  # the collector disabled by hold()
        self._frozen_at = float("-inf")  # the last gc.freeze()
        self._freeze_gap = 1.0  # seconds to the next, doubled up to GC_FREEZE_S (the start's objects are caught early)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Around the main loop; after it the collector runs again."""
        self.looping = True
        try:
            yield
        finally:
            self.looping = False
            self.hold()

    def hold(self, starting: bool = False) -> None:
        """Hold the collector in a recovery round's first :data:`ROUND_GC_HOLD_S` seconds, let it
        run again after them (called at each turn of the main loop, and with ``starting`` when a
        round starts)."""
        rec = self.job.rounds.current
        hold = self.looping and (starting or (rec is not None and self.job.clock() - rec.round_started < ROUND_GC_HOLD_S))
        if hold and not self.held and gc.isenabled():
            gc.disable()
            self.held = True
        elif not hold and self.held:
            gc.enable()
            self.held = False

    def freeze_when_due(self) -> None:
        """Outside a round, freeze what the coordinator holds when :data:`GC_FREEZE_S` (or less,
        early in the job) has passed since the last time."""
        now = self.job.clock()
        if self.job.rounds.current is None and now - self._frozen_at >= self._freeze_gap:
            self._frozen_at, self._freeze_gap = now, min(2 * self._freeze_gap, GC_FREEZE_S)
            gc.freeze()

"""A rank outliving its supervisor long enough for a dying gasp (MindIO TTP's idea).

A rank is spawned to die with its supervisor (``PR_SET_PDEATHSIG``, SIGKILL; :mod:`ftrun.common.procs`).
A library rank trades that for :data:`ORPHAN_SIGNAL`, whose handler only sets a flag: at its next
safe point (a step boundary, or its recovery loop) the rank writes its replica group's shard of
its last committed step, if it is the group's writer, and exits (:meth:`ParentWatch.check`); the
launcher, which outlives the supervisor, waits for that, completes the checkpoint and ends
whatever is left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from ftrun.rank.workerstate import Phase, WorkerState

ORPHAN_SIGNAL = signal.SIGUSR2  # the kernel sends it to a library rank when its supervisor dies


class ParentWatch:
    """Notices the supervisor's death (the parent of this process) and writes the dying gasp.

    Args:
        state: the rank's :class:`ftrun.rank.workerstate.WorkerState` (ORPHANED at the gasp).
        progress: the step loop's progress (the committed step).
        registry: the registered state (rolled back, then saved).
        checkpoints: the rank's :class:`ftrun.rank.shards.RankCheckpoints`.
        ttp: whether TTP (checkpoints) is on. world_size: ranks in the job.

    ``orphaned`` is a latch the signal handler sets; the worker reads it at its safe points
    (:meth:`check`).
    """

    def __init__(self, state: WorkerState, progress: Any, registry: Any, checkpoints: Any, ttp: bool,
                 world_size: int) -> None:
        self.state = state
        self.progress = progress
        self.registry = registry
        self.checkpoints = checkpoints
        self.ttp = ttp
        self.world_size = world_size
        self.orphaned = False

    def watch(self) -> None:
        """Switch this process's death signal to :data:`ORPHAN_SIGNAL`. The switch happens after the
        handler is installed, so the old signal covers the moment before; a parent already gone by
        then is noticed by its pid. Only on the main thread (signal handlers live there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        from ftrun.common.procs import set_death_signal

        parent = os.getppid()

        def on_orphaned(_signum: int, _frame: Any) -> None:
            self.orphaned = True

        signal.signal(ORPHAN_SIGNAL, on_orphaned)
        if set_death_signal(ORPHAN_SIGNAL) and os.getppid() != parent:
            self.orphaned = True

    def check(self, rank: int | None, mid_step: bool) -> None:
        """At a safe point: if the supervisor died, write the dying gasp and exit (never returns
        then). ``mid_step``: called while a failed step is being recovered (its body's changes
        to rank and replica objects are undone first).

        The gasp is this rank's shard of its last committed step with an orphan note
        (:func:`ftrun.common.checkpoint.write_orphan_note`), if TTP is on and this rank is its replica
        group's writer (the lowest rank); the exit code is ``128 + ORPHAN_SIGNAL``. Every rank
        reaches the same committed step: a step commits only after an all-reduce all ranks
        entered, and a rank that leaves makes its peers' next all-reduce fail, so they recover and
        gasp with the step they hold."""
        if not self.orphaned:
            return
        self.state.to(Phase.ORPHANED)
        committed = self.progress.committed
        line = f"ftrun: rank {rank}: the supervisor is gone"
        if mid_step and committed >= 0:
            self.registry.roll_back(committed, ("rank", "replica"))
        if not self.ttp or self.checkpoints.directory is None:
            line += "; no dying-gasp checkpoint (TTP is off)"
        else:
            line += self.checkpoints.save_orphaned(committed, self.registry.state_dict, self.world_size)
        print(line + "; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + ORPHAN_SIGNAL)

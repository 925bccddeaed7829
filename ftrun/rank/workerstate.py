"""Where a rank's process stands, as named phases with a table of the allowed transitions.

The worker library used to keep this in flags (an error string and its kind, a pending
recoverable error, ``joining``, ``_orphaned``, ``rank is None`` for a hot spare); they are
one :class:`Phase` now, changed only through :meth:`WorkerState.to`, which raises
:class:`IllegalTransition` on any move the table does not list. The models are torchelastic's
``WorkerState`` (torch/distributed/elastic/agent/server/api.py) and the transition table of
NVIDIA resiliency extension's rank monitor (rank_monitor_state_machine.py). No torch here.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """A rank process's phase.

    STARTING: set-up before the process knows its rank (the first moments of ``ftrun.init``).
    SPARE: a hot spare running the script's set-up without a rank, until its promotion.
    JOINING: a respawned rank (or a promoted spare) before its first recovery gives it state.
    HEALTHY: training; the last collective succeeded.
    PENDING_REPAIR: a recoverable error was raised inside ``backward`` (a gradient hook); it is
        repaired at the optimizer's step or at the step's end, outside autograd.
    REPAIRING: a recoverable error was recorded (UCE): the rank's state is suspect, it takes a replica's.
    FAILED: a collective failed (a peer died or hung): the group is dropped, a recovery follows.
    RECOVERING: in a recovery round (:class:`ftrun.rank.recovery.Recovery`).
    FINISHED: ``ft.finish()`` was called: the rank waits at the finish barrier (it still serves recoveries).
    ORPHANED: the supervisor died: the rank writes its dying gasp and exits.
    """

    STARTING = "starting"
    SPARE = "spare"
    JOINING = "joining"
    HEALTHY = "healthy"
    PENDING_REPAIR = "pending_repair"
    REPAIRING = "repairing"
    FAILED = "failed"
    RECOVERING = "recovering"
    FINISHED = "finished"
    ORPHANED = "orphaned"


_P = Phase
#: The allowed transitions: phase -> the phases it may move to.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    _P.STARTING: frozenset({_P.SPARE, _P.JOINING, _P.HEALTHY}),
    _P.SPARE: frozenset({_P.JOINING, _P.HEALTHY, _P.REPAIRING, _P.FINISHED}),
    _P.JOINING: frozenset({_P.RECOVERING, _P.REPAIRING, _P.FINISHED, _P.ORPHANED}),
    _P.HEALTHY: frozenset({_P.FAILED, _P.PENDING_REPAIR, _P.REPAIRING, _P.RECOVERING, _P.FINISHED, _P.ORPHANED}),
    # A recoverable error raised in a second model's backward keeps the step pending; repaired.
    _P.PENDING_REPAIR: frozenset({_P.PENDING_REPAIR, _P.REPAIRING, _P.FINISHED, _P.ORPHANED}),
    # A recoverable error after a failed collective (the step's body raised it) is repaired in
    # place; an error recorded while repairing keeps the phase (the round is the repair's).
    _P.REPAIRING: frozenset({_P.REPAIRING, _P.PENDING_REPAIR, _P.RECOVERING, _P.FINISHED, _P.ORPHANED}),
    _P.FAILED: frozenset({_P.FAILED, _P.PENDING_REPAIR, _P.REPAIRING, _P.RECOVERING, _P.FINISHED, _P.ORPHANED}),
    _P.RECOVERING: frozenset({_P.HEALTHY, _P.FINISHED, _P.ORPHANED}),
    _P.FINISHED: frozenset({_P.RECOVERING, _P.ORPHANED}),
    _P.ORPHANED: frozenset(),
}

#: Phases in which the step's collectives are not to run (an error is recorded or pending).
ERROR_PHASES = frozenset({_P.FAILED, _P.REPAIRING, _P.PENDING_REPAIR})


class IllegalTransition(RuntimeError):
    """A move the table (:data:`TRANSITIONS`) does not allow: a bug in ftrun, never the script's."""


class WorkerState:
    """One rank process's phase, what put it there, and its mode.

    Attributes:
        phase: the current :class:`Phase`.
        reason: the error of FAILED, REPAIRING or PENDING_REPAIR (one line); else None.
        managed: the mode, fixed when the rank is bound: True when it runs under ftrun with ARF
            (it recovers), False under plain torchrun or with ARF off (a failure ends it).
        resume: the phase a recovery returns to (HEALTHY, or FINISHED for a rank at the finish barrier).
    """

    def __init__(self, managed: bool = False) -> None:
        self.phase = Phase.STARTING
        self.reason: str | None = None
        self.managed = managed
        self.resume = Phase.HEALTHY

    def __repr__(self) -> str:
        return f"WorkerState({self.phase.name}, reason={self.reason!r}, managed={self.managed})"

    def to(self, phase: Phase, reason: str | None = None) -> None:
        """Move to ``phase`` (with its ``reason`` when it is an error phase).

        Raises:
            IllegalTransition: the table does not allow it.
        """
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"ftrun: a rank cannot go from {self.phase.name} to {phase.name}"
                                    + (f" ({reason})" if reason else ""))
        if phase is Phase.RECOVERING and self.phase is Phase.FINISHED:
            self.resume = Phase.FINISHED
        elif phase is Phase.RECOVERING:
            self.resume = Phase.HEALTHY
        self.phase = phase
        self.reason = reason if phase in ERROR_PHASES else None

    @property
    def failed(self) -> bool:
        """An error is recorded or pending: the step's remaining collectives and update are skipped."""
        return self.phase in ERROR_PHASES

    @property
    def error(self) -> str | None:
        """The recorded error (FAILED or REPAIRING), else None."""
        return self.reason if self.phase in (Phase.FAILED, Phase.REPAIRING) else None

    @property
    def fault_kind(self) -> str:
        """What a recovery from here reports: ``recoverable`` (UCE) or ``comm``."""
        return "recoverable" if self.phase is Phase.REPAIRING else "comm"

    def recover(self) -> str:
        """Enter a recovery round; returns the kind of fault it is for (:attr:`fault_kind`)."""
        kind = self.fault_kind
        self.to(Phase.RECOVERING)
        return kind

    def recovered(self) -> None:
        """The recovery round ended: back to training (or to the finish barrier)."""
        self.to(self.resume)

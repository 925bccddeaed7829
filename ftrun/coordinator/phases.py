"""The job's phases and the transitions allowed between them (a state machine in the manner of
NVIDIA resiliency-ext's rank monitor and torchelastic's ``WorkerState``).

The coordinator is in exactly one phase; :meth:`JobPhases.move` changes it and raises
:class:`IllegalPhaseTransition` on a transition the table does not hold, so a path through the code
that would, say, start a recovery while the job is being stopped fails loudly instead of leaving
two rounds interleaved.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable


class JobPhase(str, Enum):
    RUNNING = "running"  # every rank of this attempt started or training
    RECOVERING = "recovering"  # an ARF round (respawn and state transfer, or an in-place repair) runs
    GASPING = "gasping"  # live ranks write a dying-gasp checkpoint (TTP) before a restart or the end
    RESTARTING = "restarting"  # every rank stopped, the next attempt about to start (torchrun semantics)
    STOPPING = "stopping"  # every rank being stopped: the job ends (a failure, a signal, a divergence)
    FINISHED = "finished"  # the exit code is known


TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.RUNNING: frozenset({JobPhase.RECOVERING, JobPhase.GASPING, JobPhase.RESTARTING, JobPhase.STOPPING,
                                 JobPhase.FINISHED}),
    # a new round (another fault during the round), the round's end, or giving up on it
    JobPhase.RECOVERING: frozenset({JobPhase.RECOVERING, JobPhase.RUNNING, JobPhase.GASPING, JobPhase.RESTARTING,
                                    JobPhase.STOPPING, JobPhase.FINISHED}),
    JobPhase.GASPING: frozenset({JobPhase.RESTARTING, JobPhase.STOPPING}),
    # the new attempt's ranks started, or it could not start (no port for its store): the job ends
    JobPhase.RESTARTING: frozenset({JobPhase.RUNNING, JobPhase.STOPPING}),
    JobPhase.STOPPING: frozenset({JobPhase.FINISHED}),
    JobPhase.FINISHED: frozenset(),
}


class IllegalPhaseTransition(RuntimeError):
    """A move the transition table does not allow (a defect in the coordinator, never user input)."""




class JobPhases:
    """The current phase and its history.

    Args:
        on_change: called with (old, new) after every move (the coordinator logs it).
    """

    def __init__(self, on_change: Callable[[JobPhase, JobPhase], None] | None = None) -> None:
        self.current = JobPhase.RUNNING
        self.history: list[JobPhase] = [self.current]
        self._on_change = on_change

    def move(self, to: JobPhase) -> None:
        """Enter phase ``to``.

        Raises:
            IllegalPhaseTransition: ``to`` is not allowed from the current phase.
        """
        if to not in TRANSITIONS[self.current]:
            raise IllegalPhaseTransition(f"job phase {self.current.value} -> {to.value} is not allowed "
                                         f"(allowed: {', '.join(sorted(p.value for p in TRANSITIONS[self.current])) or 'none'})")
        old, self.current = self.current, to
        self.history.append(to)
        if self._on_change is not None:
            self._on_change(old, to)

    def __repr__(self) -> str:
        return f"JobPhases({self.current.value})"

"""The job's hard state: the counters a standby coordinator needs to go on with the job, and the
failures kept for the final summary. The coordinator owns one :class:`JobState`; its roles move it
on through the methods below (a new generation, restarts spent, a new attempt), never by writing
the coordinator's attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftrun.coordinator.ranks import Failure


@dataclass
class JobState:
    """Counters and failures of one job (what :func:`ftrun.coordinator.failover.hard_state` replicates,
    with the rank table and the nodes).

    Attributes:
        epoch: the coordinator epoch, moved on by every takeover (:mod:`ftrun.coordinator.failover`).
        takeover_at: when this coordinator took the job over (its clock, seconds), if it did.
        attempt: whole-job attempts before this one (0: the first).
        generation: process groups built in this attempt (bumped on every reconfiguration;
            TorchFT's quorum id).
        restarts_used: restarts spent against ``max_restarts`` (rank respawns and whole-job restarts).
        failures: every rank failure of the job, in order.
        round_failures: the failures since the last recovery ended (the root cause is the first).
    """

    epoch: int = 0
    takeover_at: float = 0.0
    attempt: int = 0
    generation: int = 0
    restarts_used: int = 0
    failures: list[Failure] = field(default_factory=list)
    round_failures: list[Failure] = field(default_factory=list)

    def next_generation(self) -> int:
        """Move on to the next generation and return it."""
        self.generation += 1
        return self.generation

    def heard_of(self, generation: int) -> None:
        """A rank heard of ``generation`` (from a coordinator that died): the next one goes beyond it."""
        self.generation = max(self.generation, generation)

    def spend_restarts(self, count: int) -> None:
        """Count ``count`` more restarts against the budget."""
        self.restarts_used += count

    def record_failure(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.round_failures.append(failure)

    def round_ended(self) -> None:
        """A recovery ended: the next failure starts a new round of root causes."""
        self.round_failures = []

    def new_attempt(self) -> None:
        """A whole-job restart: the next attempt starts at generation 0."""
        self.round_failures = []
        self.attempt += 1
        self.generation = 0


class JobStateField:
    """An attribute of the coordinator that reads and writes its :class:`JobState` (the roles and
    tools that read ``job.generation`` keep working)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, job: Any, owner: type | None = None) -> Any:
        return self if job is None else getattr(job.state, self.name)

    def __set__(self, job: Any, value: Any) -> None:
        setattr(job.state, self.name, value)

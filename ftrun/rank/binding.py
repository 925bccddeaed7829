"""The binding of a process to its rank: its identity taken from the environment and handed to
the worker's roles, and its place in the job's process group.

A rank started by its launcher is bound when :func:`ftrun.rank.worker.init` builds its
:class:`ftrun.rank.worker.Worker`; a hot spare (docs/hot_spares.md) runs its script's set-up
without a rank and is bound at its promotion (:func:`ftrun.rank.promotion.await_promotion`), when
the script reaches its loop or first asks for its rank. :class:`RankBinding` holds the identity
(rank, local rank, incarnation, device, replica group) and does both, and builds the group of
each generation the rank joins; it uses the worker's public members and roles only.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from typing import TYPE_CHECKING, Sequence

import torch

from ftrun.common.contract import INITIAL, NO_STATE, RankEnv
from ftrun.common.faults import FaultInjector
from ftrun.rank.client import open_channel, training_thread_probe
from ftrun.rank.cuda import bind_device
from ftrun.rank.workerstate import Phase

if TYPE_CHECKING:
    from ftrun.rank.worker import Worker

DUMP_SIGNAL = signal.SIGUSR1  # the supervisor asks a hung rank for its Python stacks with this


def replica_group_of(rank: int, groups: Sequence[Sequence[int]] | None, world_size: int) -> list[int]:
    """The replica group of ``rank`` in ``groups`` (None: every rank is a replica of every other).

    Raises:
        ValueError: no group contains ``rank``.
    """
    if groups is None:
        return list(range(world_size))
    for group in groups:
        if rank in group:
            return sorted(int(r) for r in group)
    raise ValueError(f"replica_groups {groups} do not contain rank {rank}")


class RankBinding:
    """This process's identity as a rank, its binding to the worker's roles, and its group's builds.

    Args:
        worker: the rank's handle, whose roles (group, checkpoints, recovery, checks, control, sync,
            parent watch) take the identity.
        replica_groups: the partition of ranks into replica groups given to ``init`` (None: pure data
            parallel).

    Attributes:
        rank, local_rank, incarnation, device, replica_group: the identity (None before the
            binding: a hot spare before its promotion).
        promoted_at: a hot spare: what was waiting for the rank at its promotion (None: not a spare).
    """

    def __init__(self, worker: Worker, replica_groups: Sequence[Sequence[int]] | None) -> None:
        self.worker = worker
        self.replica_groups = replica_groups
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.incarnation: int | None = None
        self.device: torch.device | None = None
        self.replica_group: list[int] | None = None
        self.promoted_at: str | None = None

    def start(self, hot_spare: bool) -> None:
        """At ``init``: bind this process to its rank and build the first generation's group (a
        respawned rank builds none: it joins a recovery's); a hot spare is left unbound until its
        promotion."""
        worker = self.worker
        if hot_spare:
            # Until its promotion it is what a respawned rank is before its transfer: no state, no
            # group, no initial broadcast; its identity is unknown.
            worker.state.to(Phase.SPARE)
            worker.state.managed, worker.committed = True, NO_STATE
            worker.resume_dir = None
            worker.faults = worker.sync.faults
            return
        self.bind()
        if worker.world_size > 1 and not worker.joining:
            worker.committed = NO_STATE  # until the group stands: an abort may overtake the build
            if self.build_group(worker.generation):
                worker.committed = INITIAL
            else:
                worker.state.to(Phase.FAILED, "a rank failed before the process group was built")
                worker.group.install_placeholder()
        elif worker.joining:
            worker.group.install_placeholder()  # its set-up may ask torch.distributed for its rank

    def build_group(self, generation: int) -> bool:
        """Build the default process group of ``generation`` (:meth:`ftrun.rank.group.TrainingGroup.build`).
        False if an abort overtook it while this rank waited for its peers."""
        worker = self.worker

        def abandon() -> bool:
            if worker.control.poll_abort(timeout=0.005, newer_than=generation):
                return True
            worker.parent.check(self.rank, mid_step=True)
            return False

        if not worker.group.build(generation, abandon):
            return False
        if worker.managed:
            worker.generation = generation
        return True

    def bind(self) -> None:
        """Take this process's identity from the environment (at start, or at a hot spare's
        promotion): rank, incarnation, generation, its control channel and fault injection."""
        worker = self.worker
        env = worker.env = RankEnv.from_environ(os.environ)
        self.rank = rank = env.rank if env.rank is not None else 0
        self.local_rank = env.local_rank if env.local_rank is not None else 0
        self.incarnation = incarnation = env.incarnation or 0
        worker.attempt = env.attempt
        worker.generation = env.generation or 0
        self.device, worker.memory_wait = bind_device(worker.backend, worker.device_request, self.local_rank, rank,
                                                      respawned=incarnation > 0)  # ftrun.rank.cuda
        self.replica_group = replica_group_of(rank, self.replica_groups, worker.world_size)
        worker.faults = worker.sync.faults = FaultInjector.from_env(rank, incarnation, worker.attempt)
        channel = open_channel(True, self.replica_group, worker.generation, env=env,
                               **({"hot": self.promoted_at} if self.promoted_at is not None else {}))
        worker.managed = managed = channel is not None and env.arf
        worker.group.bind(rank, incarnation, worker.attempt, managed)
        worker.checkpoints.bind(rank)
        # A rank respawned into a running job (ARF) builds no group of its own: it joins the
        # recovery's generation from its first call to steps(), and holds no state until then.
        joining = managed and (incarnation > 0 and worker.generation > 0)
        worker.state.to(Phase.JOINING if joining else Phase.HEALTHY)
        worker.committed = NO_STATE if joining else INITIAL
        worker.recovery.bind(rank, worker.attempt, worker.faults, fresh=joining)
        worker.checks.bind(rank, worker.attempt, self.device, self.replica_group)
        # Checkpoints (TTP): the one to start from (not for a respawned rank, which takes a live
        # replica's newer state).
        worker.resume_dir = None if joining else env.resume_dir
        worker.faults.cut_connections = worker.group.cut
        worker.control.attach(channel, probe=training_thread_probe(threading.main_thread().ident, worker.sync.waiting,
                                                                   worker.progress, worker.control.board),
                              beat_extra=worker.control.beat_progress)
        if channel is not None:
            # Stacks of every thread into this rank's log when the supervisor suspects a hang.
            faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
            if managed:
                worker.parent.watch()  # outlive the supervisor for a dying gasp (ftrun.rank.orphan)

    def await_promotion(self, what: str) -> None:
        """A hot spare: block until the agent gives it a rank (:func:`ftrun.rank.promotion.take_assignment`),
        then bind it. ``what`` names what needed the rank ("the training loop", or "ft.rank" when
        the script asked in its set-up: the spare then did part of its set-up after promotion,
        as a warm spare does, and the coordinator says so)."""
        from ftrun.rank.promotion import await_promotion

        self.promoted_at = what
        await_promotion(what, self.worker.env.spare_ready)
        self.bind()
        if not self.worker.joining:  # promoted outside a recovery (not expected): join as a respawned rank does
            raise RuntimeError("ftrun: a hot spare was promoted without a recovery to join")
        self.worker.group.install_placeholder()

    def identity(self, what: str) -> None:
        """Before ``what`` (``"ft.rank"``...) reads the identity: a hot spare not promoted yet waits
        for its promotion here."""
        if self.worker.state.phase is Phase.SPARE:
            self.await_promotion(what)

"""One rank's part in a recovery (ARF; the recovery role, split out of :class:`ftrun.rank.worker.Worker`).

From a fault to the next generation: the rank drops its group, reports where it stands (its
current and committed step) unless the supervisor's abort already asked, waits for the
coordinator's plan (generation, recovery step S, transfers), builds that generation's group,
undoes what a failed step's body did after its update (the step-start snapshot of the state
registry), sends or receives the replica state (:mod:`ftrun.rank.transfer`), and reports it recovered.
Training resumes at S + 1. A respawned rank does the same from its first loop call, and then takes
its predecessor's own state (data position, RNG) from the job's store (:mod:`ftrun.rank.rankstate`).

The step loop (:class:`ftrun.rank.worker.Worker`) and this class share one :class:`RankProgress`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from ftrun.rank.cuda import wire_device
from ftrun.errors import describe
from ftrun.common.contract import INITIAL, NO_STATE
from ftrun.common.protocol import Message, MsgType
from ftrun.rank.transfer import recv_state, send_state, state_bytes


@dataclass
class RankProgress:
    """Where a rank stands, shared by its step loop and its recovery.

    Attributes:
        committed: the last step whose update finished here (-1: the initial state; -2: no
            usable state, e.g. a respawned rank before its transfer).
        generation: the generation of the process group it holds or last held.
        current_step: the step being run (None before the first).
        stage: where the training thread is in ftrun's own flow, for the coordinator's watchdog
            (sent with each heartbeat): ``setup`` (the script's set-up), ``init`` (the initial
            broadcast), ``loop``, or a recovery's ``recover`` (dropping the group, reporting),
            ``wait_plan``, ``build`` (the new group), ``transfer`` (moving state).
        stage_bytes: the bytes of state the current stage moves (``transfer``; else 0): the
            coordinator's bound on a stall grows with it.
    """

    committed: int = INITIAL
    generation: int = 0
    current_step: int | None = None
    stage: str = "setup"
    stage_bytes: int = 0


class Recovery:
    """Carries out recoveries for one rank.

    Args:
        progress: the rank's :class:`RankProgress` (read and updated).
        group: its :class:`ftrun.rank.group.TrainingGroup` (dropped here; built through ``build_group``).
        control: its :class:`ftrun.rank.client.ControlClient` (reports, plans).
        registry: its :class:`ftrun.rank.registry.StateRegistry` (rolled back, sent, received).
        build_group: builds a generation's group, False if a newer abort overtook it.
        safe_point: called on every turn of the wait for a plan (the worker writes a requested
            dying-gasp checkpoint there, and exits if its supervisor is gone).
        seed: the script's ``init(seed=...)`` (a seeded rank loses nothing without its record).
        check_replicas: called on every rank with the recovery step once the transfers are done:
            replicas compare their parameters (a collective of the new generation); False if it
            failed, which is handled as a failed transfer.
        read_checkpoint: ``read_checkpoint(directory)`` is this rank's own part (``{name: state}``) of
            the checkpoint in ``directory``, for a plan that rolls every rank back to it
            (:func:`ftrun.coordinator.policy.plan_rollback`); raises if it does not load.

    :meth:`bind` gives it the rank's identity (late for a hot spare).
    """

    def __init__(self, progress: RankProgress, group: Any, control: Any, registry: Any,
                 build_group: Callable[[int], bool], safe_point: Callable[[], None], seed: int | None,
                 check_replicas: Callable[[int], bool] | None = None,
                 read_checkpoint: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.progress = progress
        self.group = group
        self.control = control
        self.registry = registry
        self.build_group = build_group
        self.safe_point = safe_point
        self.seed = seed
        self.check_replicas = check_replicas
        self.read_checkpoint = read_checkpoint
        self.rank: int | None = None
        self.attempt = 0
        self.faults: Any = None
        self.fresh = False  # a respawned rank that has not recovered yet (reads its record then)
        self._rank_record: Any = None  # ftrun.rank.rankstate.RankRecord fetched for a respawned rank
        # What the predecessor of a respawned rank recorded of the step it computed but did not see
        # committed: (step, digest of its local gradient), compared when this rank recomputes it.
        self.predecessor_gradient: tuple[int, str] | None = None

    def bind(self, rank: int, attempt: int, faults: Any, fresh: bool) -> None:
        """Set the rank's identity: rank, whole-job attempt, fault injector, and whether it is a
        respawned rank that has not recovered yet."""
        self.rank, self.attempt, self.faults, self.fresh = rank, attempt, faults, fresh

    def recover(self, reason: str | None, kind: str) -> int:
        """Reconfigure after a fault; returns the recovery step S (training resumes at S + 1).

        ``reason``: this rank's own fault (None: it answers the supervisor's abort), reported as
        ``kind`` (``comm``, ``recoverable``) unless an abort already asked."""
        progress = self.progress
        progress.stage, progress.stage_bytes = "recover", 0
        self.faults.point("recover", progress.current_step)
        self.group.drop(progress.generation)
        if reason is not None and self.control.abort_generation is None:
            # Tell the supervisor now; it answers with an abort naming the next generation.
            self.control.send(MsgType.FAULT, generation=progress.generation, step=progress.current_step or -1,
                              committed=progress.committed, reason=reason, kind=kind)
        # A plan for the pending abort is kept: an earlier poll can take it with the abort when the
        # coordinator was quick (a UCE rank's own report is its answer).
        self.control.drop_stale_plan()
        while True:
            progress.stage = "wait_plan"
            self.control.poll(timeout=1.0)
            self.safe_point()
            plan = self.control.take_plan()
            if plan is not None and self.carry_out(plan):
                return plan["step"]

    def carry_out(self, plan: Message) -> bool:
        """This rank's part in ``plan``: build its generation's group, roll back or take state, and
        say it recovered. False when the plan failed here (reported when this rank can tell why):
        the recovery waits for the next plan."""
        progress = self.progress
        generation = plan["generation"]
        if isinstance(plan.get("store"), str):
            self.group.move_store(plan["store"])  # a standby coordinator took the job over
        started = time.monotonic()
        progress.stage = "build"
        try:
            if not self.build_group(generation):
                return False
        except dist.DistError as err:
            # The store the plan named went away during the build (the coordinator that made
            # the plan died with its host: the next coordinator in line sends another plan,
            # with its own store), or a peer left the rendezvous. This plan failed, not this
            # rank: report it (the coordinator starts the next round) and wait for the next.
            self.group.abandon_build(generation)
            self.control.send(MsgType.FAULT, generation=generation, step=plan["step"], committed=progress.committed,
                              reason=f"building generation {generation}'s group failed: {describe(err)}", kind="comm")
            return False
        rebuild_s = time.monotonic() - started
        # A retried step: undo what the failed body did after (or instead of) its update. A
        # recipient takes replica state from its donor, so only its own rank state rolls back.
        rollback = plan.get("rollback")  # a checkpoint's directory: every rank rolls back to it
        progress.stage = "transfer"
        if rollback is not None:
            role, nbytes, transfer_s = self.load_checkpoint(str(rollback))
        else:
            recipient = any(int(r) == self.rank for _, r in plan["transfers"])
            self.registry.roll_back(plan["step"], ("rank",) if recipient else ("rank", "replica"))
            role, nbytes, transfer_s = self.transfer(plan)
        progress.stage, progress.stage_bytes = "loop", 0
        if role == "failed":
            self.group.drop(progress.generation)
            self.control.send(MsgType.FAULT, generation=generation, step=plan["step"], committed=progress.committed,
                              reason="state transfer failed", kind="comm")
            return False
        self.control.recovered(generation)  # unless a newer abort is pending, waits are real again
        progress.committed = plan["step"]
        if self.fresh:
            self.fresh = False
            if rollback is None:  # a rollback's checkpoint holds this rank's own state too
                self._fetch_rank_record(plan["step"])
        self.control.send(MsgType.RECOVERED, generation=generation, role=role, bytes=nbytes,
                          seconds=transfer_s, rebuild_seconds=rebuild_s)
        return True

    def transfer(self, plan: Message) -> tuple[str, int, float]:
        """Carry out this rank's part of the plan: ('donor'|'recipient'|'none'|'failed', bytes, seconds)."""
        started = time.monotonic()
        transfers = [(int(d), int(r)) for d, r in plan["transfers"]]
        as_donor = [r for d, r in transfers if d == self.rank]
        as_recipient = [d for d, r in transfers if r == self.rank]
        nbytes = 0
        received_any = False
        if as_donor or as_recipient or self.check_replicas is not None:  # what it sends, receives or fingerprints
            self.progress.stage_bytes = state_bytes(self.registry.state_dict(exclude=("rank",)))
        wire = wire_device(self.group.backend) if as_donor or as_recipient else "cpu"  # CUDA with NCCL (ftrun.rank.cuda)
        try:
            for recipient in as_donor:
                def progress(sent: int, _step: int = plan["step"]) -> None:
                    if sent:
                        self.faults.point("transfer", _step)

                nbytes += send_state(self.registry.state_dict(exclude=("rank",)), recipient, on_progress=progress,
                                     device=wire)
            for donor in as_recipient:
                self.faults.point("rejoin", plan["step"])
                # A survivor behind its replicas keeps its own buffers (rank state, which the
                # donor's model state carries too): only a rank without state takes the donor's.
                own = self.registry.buffer_values() if self.progress.committed >= INITIAL else None
                received_any = True
                state, n = recv_state(donor, self.registry.state_dict(exclude=("rank",)), device=wire)
                nbytes += n
                self.registry.load(state)
                if own is not None:
                    self.registry.load_buffer_values(own)
        except Exception as err:
            if received_any:
                self.progress.committed = NO_STATE  # a half-received state is no state
            self.control.send(MsgType.ERROR, reason=f"state transfer failed: {type(err).__name__}: {err}")
            return "failed", nbytes, time.monotonic() - started
        role = "recipient" if as_recipient else "donor" if as_donor else "none"
        if self.check_replicas is not None and not self.check_replicas(plan["step"]):  # every rank, after the transfers
            return "failed", nbytes, time.monotonic() - started
        return role, nbytes, time.monotonic() - started

    def load_checkpoint(self, directory: str) -> tuple[str, int, float]:
        """Roll this rank back in place to its own part of the checkpoint in ``directory`` (every
        registered object, its own rank state included): ('rollback'|'failed', bytes, seconds).
        A part that does not load leaves no usable state (the next round's plan says what then)."""
        started = time.monotonic()
        try:
            if self.read_checkpoint is None:
                raise RuntimeError("this rank reads no checkpoints")
            self.progress.stage_bytes = state_bytes(self.registry.state_dict(exclude=("rank",)))
            state = self.read_checkpoint(directory)
            self.registry.load(state)
        except Exception as err:
            self.progress.committed = NO_STATE
            self.control.send(MsgType.ERROR, reason=f"rolling back to checkpoint {directory} failed: {describe(err)}")
            return "failed", 0, time.monotonic() - started
        return "rollback", state_bytes(state), time.monotonic() - started

    def _fetch_rank_record(self, step: int) -> None:
        """A respawned rank: fetch its predecessor's own state at committed ``step`` from its record stores
        (applied where its first step begins, :meth:`ftrun.rank.worker.Worker.epochs`) and the digest of
        the local gradient it computed for ``step + 1``, if it got that far; without a record, say
        that it starts fresh."""
        from ftrun.rank.rankstate import open_rank_records

        record = None
        failure = None
        try:
            records = open_rank_records(self.group, self.attempt, self.rank)
            record = records.get(step)
            if record is not None and records.source is not records.store:
                print(f"ftrun: rank {self.rank}: its predecessor's own state at step {step} comes from the copy at "
                      "its buddy node (its own node's record store has none: the node was replaced)",
                      file=sys.stderr, flush=True)
            digest = records.get_gradient_digest(step + 1)
            self.predecessor_gradient = (step + 1, digest) if digest is not None else None
        except Exception as err:
            failure = describe(err)
        if record is not None:
            self._rank_record = record
        elif step >= 0 and (self.seed is None or failure is not None):
            print(f"ftrun: rank {self.rank}: no record of its own state (RNG, data position) at step {step}"
                  f"{': ' + failure if failure else ''}; it continues from a fresh one", file=sys.stderr, flush=True)

    def pending_rank_record(self) -> Any:
        """The predecessor's record fetched by the last recovery and not applied yet (a
        :class:`ftrun.rank.rankstate.RankRecord`), or None."""
        return self._rank_record

    def take_rank_record(self) -> Any:
        """The predecessor's record fetched by the last recovery, once (then forgotten here)."""
        record, self._rank_record = self._rank_record, None
        return record

"""The step loop of a rank: what runs between the script's ``for step in ft.steps(...)`` (or
``ft.batches(...)``) and its body, and what a rank does after its last step.

:class:`StepLoop` enters the loop (a hot spare's promotion, a resume from a checkpoint, a respawned
rank's join, a recovery of a failed initial broadcast), runs each step (the reseed, the rank-state
snapshot, the settling of abandoned all-reduces, the commit at the body's end, the periodic
checkpoint), recovers a failed step (:meth:`ftrun.rank.recovery.Recovery.recover`) and retries it, and
serves recoveries from the finish barrier until every rank finished. It is the
:class:`ftrun.rank.worker.Worker`'s, and uses that handle's public members and roles only.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator

import torch

from ftrun.common.contract import NO_STATE
from ftrun.rank.workerstate import Phase

if TYPE_CHECKING:
    from ftrun.rank.worker import Worker


class GroupFailure(RuntimeError):
    """A collective on ftrun's process group failed (recorded, then recovered by :meth:`Worker.steps`)."""


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of (seed, step, rank): 63 bits of a SHA-256, independent of Python's hash salt."""
    digest = hashlib.sha256(f"ftrun:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and ``random``."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class Step(int):
    """A step number (an ``int``) that guards the step's body when used as ``with step:``.

    A :class:`RecoverableError` (or a type named in ``--recoverable_errors``) raised inside the
    block does not end the process: the exception is suppressed, the rank reports it, drops its
    state, takes a replica's, and every rank retries the step (MindSpore's UCE). Any other
    exception propagates, the process dies, and ARF replaces it.
    """

    _worker: Worker
    index: int | None  # the batch's place in its pass (ft.batches), counted from 0; else None

    def __new__(cls, value: int, worker: Worker, index: int | None = None) -> "Step":
        obj = super().__new__(cls, value)
        obj._worker = worker
        obj.index = index
        return obj

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, _tb: Any) -> bool:
        return exc is not None and self._worker.repair_step_error(exc)


class StepLoop:
    """The loop of one rank's steps: enter, run, recover and retry, and the finish barrier.

    Args:
        worker: the rank's handle (its roles: state, progress, registry, control, recovery, checks,
            sync, checkpoints, parent watch, epoch loop, trace).

    Attributes:
        first_step: the job's first step (DDP's one-bucket iteration), set when the loop is entered.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.first_step = 0

    def enter(self, step: int) -> int:
        """Before the first step ``step``: resume from a checkpoint, or join the job (a respawned
        rank), or recover from a failed initial broadcast. Returns the first step to run."""
        worker = self.worker
        self.first_step = step
        if worker.state.phase is Phase.SPARE:
            worker.binding.await_promotion("the training loop")  # a hot spare: its set-up is done
        if worker.resume_dir is not None:
            step = max(step, self.resume() + 1)
        if worker.joining:
            worker.control.abort_generation = worker.generation  # its hello was its report for this generation
            step = self.recover(None) + 1
        elif worker.state.error is not None:  # the initial broadcast failed
            step = self.recover(worker.state.error) + 1
        return step

    def run(self, step: int, total: int | None, cursor: Any) -> Generator[tuple[Step, Any], None, int]:
        """The step loop shared by :meth:`Worker.steps` and :meth:`Worker.batches`: run steps from
        ``step`` up to ``total`` (or until ``cursor``'s loader is exhausted), recovering and
        retrying failed ones. Returns the step after the last one run."""
        worker = self.worker
        first = step
        while total is None or step < total:
            worker.parent.check(worker.binding.rank, mid_step=False)
            if worker.control.poll_abort():
                step = self.recover(None) + 1
                if cursor is not None and worker.epoch_loop.epoch_moved(cursor):
                    return step
                continue
            # A respawned rank: its predecessor's own state, where the predecessor's next step
            # began (or would have: after the pass's last step it goes on to the epoch's end).
            worker.checks.apply_rank_record()
            if cursor is not None and cursor.exhausted():
                break
            self.begin(step, total, cursor, mid_pass=step > first)
            batch = None
            if cursor is not None:
                try:
                    batch = cursor.next()
                except StopIteration:
                    break
            worker.sync.settle()  # no abandoned all-reduce can write into this step's gradients
            worker.sync.begin_step()
            yield Step(step, worker, cursor.position - 1 if cursor is not None else None), batch
            if not self.end(step):
                step = self.recover(worker.state.error) + 1
                if cursor is not None and worker.epoch_loop.epoch_moved(cursor):
                    return step
                continue
            worker.faults.point("between_steps", step)
            step += 1
        return step

    def begin(self, step: int, total: int | None, cursor: Any, mid_pass: bool) -> None:
        """The start of ``step``: its fault point, its place on the step board, its seed and its
        rank-state snapshot."""
        worker = self.worker
        worker.faults.point("before_forward", step)
        worker.progress.current_step, worker.progress.stage = step, "loop"
        worker.control.board.begin(step, total if cursor is None else worker.epoch_loop.total(cursor))
        if worker.seed is not None:
            seed_everything(step_seed(worker.seed, step, worker.rank))
        if worker.managed:
            worker.checks.snapshot_step_start(mid_pass=mid_pass)

    def end(self, step: int) -> bool:
        """The end of ``step``'s body: a pending repair, the commit, the periodic checkpoint.
        False when the step failed (or an abort came) and must be recovered."""
        worker = self.worker
        worker.sync.in_collective = False
        if worker.state.phase is Phase.PENDING_REPAIR:  # raised in backward, and no opt.step() followed
            worker.sync.repair(worker.state.reason or "", True)
        if not worker.state.failed and worker.committed == step - 1:
            # The body ended well: its updates are the step's (several optimizers), or it made
            # none (GradScaler skipped it) and the state is that of this step all the same.
            worker.commit(step)
            worker.control.board.enter("compute")
        if not worker.state.failed:
            worker.registry.transaction.end()
        if worker.state.failed or (worker.managed and worker.control.abort_generation is not None):
            return False
        if worker.save_steps and (step + 1) % worker.save_steps == 0 and worker.committed == step:
            worker.checkpoints.save_periodic(step, worker.state_dict)
        return True

    def recover(self, reason: str | None) -> int:
        """Reconfigure after a fault (:meth:`ftrun.rank.recovery.Recovery.recover`); returns the
        recovery step S (training resumes at S + 1).

        Raises:
            GroupFailure: this rank runs without a supervisor (plain torchrun), so it cannot recover.
        """
        worker = self.worker
        if not worker.managed:
            raise GroupFailure(reason or "collective failed")
        if not worker.registry.undo_updates(f"rank {worker.rank}: step {worker.progress.current_step}"):
            worker.committed = NO_STATE  # a partial step that nothing can undo: it takes a replica's state
        kind = worker.state.recover()
        step = worker.recovery.recover(reason, kind)
        worker.state.recovered()
        return step

    def safe_point(self) -> None:
        """On every turn of a recovery's wait: exit with a dying gasp if the supervisor is gone,
        write a dying-gasp checkpoint the supervisor asked for."""
        worker = self.worker
        worker.parent.check(worker.binding.rank, mid_step=True)
        self.save_requested()

    def save_requested(self) -> None:
        """Write a dying-gasp checkpoint (TTP) the supervisor asked for: the state is the committed step's."""
        worker = self.worker
        if worker.control.save_request is not None:
            worker.checkpoints.save_requested(worker.control.take_save_request(), worker.committed, worker.state_dict())

    def resume(self) -> int:
        """Load this rank's shard of the checkpoint the supervisor chose (TTP); returns its step."""
        worker = self.worker
        started = time.monotonic()
        directory, worker.resume_dir = Path(worker.resume_dir or ""), None
        worker.registry.load(worker.checkpoints.resume(directory))
        worker.committed = worker.env.resume_step if worker.env.resume_step is not None else -1
        print(f"ftrun: rank {worker.rank} resumed from {directory} (step {worker.committed}) in "
              f"{time.monotonic() - started:.2f} s", flush=True)
        return worker.committed

    def finish_barrier(self) -> None:
        """Serve aborts and plans (as a donor, usually) until the coordinator says every rank finished."""
        worker = self.worker
        worker.control.finished = False
        while not worker.control.finished:
            worker.parent.check(worker.binding.rank, mid_step=False)
            self.save_requested()
            if worker.control.poll_abort(timeout=0.5):
                self.recover(None)  # the abort already carried this rank's report
                worker.group.drop(worker.generation, False)

"""One rank's part in checkpoints (split out of :class:`ftrun.worker.Worker`): loading its shard
to resume, writing its replica group's shard every ``--save_steps`` in the background, and the
dying-gasp shard the supervisor asks for (MindIO TTP's idea) or an orphaned rank writes.

Replicas hold the same state, so one shard per replica group is the whole state: the group's
lowest rank is its *writer* (:attr:`RankCheckpoints.writer`). The supervisor completes a
checkpoint once every shard of a step is written (:mod:`ftrun.checkpoint`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    load_shard,
    mark_unusable,
    save_shard,
    shard_of_rank,
    step_dir,
    write_orphan_note,
)
from .errors import describe
from .protocol import MsgType


class RankCheckpoints:
    """This rank's checkpoint writing and loading.

    Args:
        directory: ``--checkpoint_dir`` (None: no periodic checkpoints, no dying gasp).
        replica_groups: the job's replica groups (lists of ranks), for the shard numbers.
        send: sends a message to the supervisor (``send(MsgType, **fields)``): ``saved`` when a
            shard is written, ``error`` when writing failed.

    :meth:`bind` gives it the rank (late for a hot spare).
    """

    def __init__(self, directory: str | None, replica_groups: Sequence[Sequence[int]],
                 send: Callable[..., None]) -> None:
        self.directory = directory
        self.replica_groups = [list(g) for g in replica_groups]
        self.send = send
        self.rank: int | None = None
        self._async: AsyncCheckpointer | None = None

    def bind(self, rank: int) -> None:
        self.rank = rank

    @property
    def shard(self) -> int:
        """This rank's shard number (its replica group's index)."""
        return shard_of_rank(self.rank, self.replica_groups)

    @property
    def writer_rank(self) -> int:
        """The rank that writes this rank's replica group's shard (the group's lowest)."""
        return min(next(g for g in self.replica_groups if self.rank in g))

    @property
    def writer(self) -> bool:
        """Whether this rank writes its replica group's shard."""
        return self.rank == self.writer_rank

    def resume(self, directory: Path) -> dict[str, Any]:
        """This rank's shard of the checkpoint in ``directory`` (``{name: state}``).

        Raises:
            CheckpointError: the shard does not load (:func:`~ftrun.checkpoint.load_shard`); the
                checkpoint is then marked unusable (:func:`~ftrun.checkpoint.mark_unusable`), so the
                whole-job restart that follows starts from the next older one.
        """
        try:
            return load_shard(directory, self.shard)
        except CheckpointError as err:
            mark_unusable(directory, err)
            raise

    def save_periodic(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Snapshot ``state()`` (the state of committed ``step``) and write it in the background, if
        this rank is its group's writer and a directory is set; ``saved`` or ``error`` follows."""
        if self.directory is None or not self.writer:
            return
        if self._async is None:
            self._async = AsyncCheckpointer(self.directory, self.shard)
        started = time.monotonic()
        shard = self.shard

        def done(saved_step: int, result: Any) -> None:
            if isinstance(result, BaseException):
                self.send(MsgType.ERROR, reason=f"checkpoint of step {saved_step} failed: {describe(result)}",
                          checkpoint=saved_step)
            else:
                self.send(MsgType.SAVED, step=saved_step, shard=shard, info=result.to_json(),
                          seconds=time.monotonic() - started, torch_version=torch.__version__, reason="periodic")

        self._async.save(step, state(), on_done=done)

    def save_requested(self, request: Any, committed: int, state: dict[str, Any]) -> None:
        """Write the shard the supervisor's ``save`` message names (a dying gasp, TTP), at a safe
        point where this rank holds exactly committed ``committed``; ``saved`` or ``error`` follows."""
        started = time.monotonic()
        failure: str | None = None
        try:
            if committed != request["step"]:
                raise RuntimeError(f"this rank holds step {committed}, not {request['step']}")
            info = save_shard(Path(request["directory"]), request["shard"], state)
        except Exception as err:
            failure = describe(err)
        if failure is not None:
            self.send(MsgType.ERROR, reason=f"dying-gasp checkpoint failed: {failure}")
            return
        self.send(MsgType.SAVED, step=request["step"], shard=request["shard"], info=info.to_json(),
                  seconds=time.monotonic() - started, torch_version=torch.__version__, reason=request["reason"])

    def save_orphaned(self, committed: int, state: Callable[[], dict[str, Any]], world_size: int) -> str:
        """The supervisor is gone: write this group's shard of committed ``committed`` with an orphan
        note (:func:`ftrun.checkpoint.write_orphan_note`) if this rank is the writer. Returns what
        happened, as the end of a log line."""
        if self.directory is None:
            return "; no dying-gasp checkpoint (no --checkpoint_dir)"
        if not self.writer:
            return f"; rank {self.writer_rank} writes its replica group's shard"
        if committed < 0:
            return "; no committed step to save"
        directory = step_dir(self.directory, committed)
        try:
            self.close()
            info = save_shard(directory, self.shard, state())
            write_orphan_note(directory, self.shard, info, world_size, self.replica_groups, torch.__version__)
        except Exception as err:
            return f"; its dying-gasp checkpoint failed: {describe(err)}"
        return f"; wrote shard {self.shard} of step {committed} to {directory}"

    def close(self) -> None:
        """Wait for the periodic checkpoint being written, if any."""
        if self._async is not None:
            self._async.close()

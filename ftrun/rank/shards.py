"""One rank's part in checkpoints (split out of :class:`ftrun.rank.worker.Worker`): loading its shard
to resume, writing its replica group's shard every ``--save_steps`` in the background, and the
dying-gasp shard the supervisor asks for (MindIO TTP's idea) or an orphaned rank writes.

Replicas hold the same state, so one shard per replica group is the whole state: the group's
lowest rank is its *writer* (:attr:`RankCheckpoints.writer`). The supervisor completes a
checkpoint once every shard of a step is written (:mod:`ftrun.common.checkpoint`).

A job whose models are sharded (FSDP2, HSDP, tensor parallelism: :mod:`ftrun.rank.sharding`) writes a
*sliced* checkpoint: its models and their optimizers' state go in DCP's format, each writer its
own slice with no collective (:mod:`ftrun.rank.dcp`), the rest of its registered state in its shard
file as before; such a checkpoint resumes onto another world size or mesh shape.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ftrun.common.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    Manifest,
    ShardInfo,
    canonical_groups,
    check_file,
    load_shard,
    mark_unusable,
    save_shard,
    shard_of_rank,
    step_dir,
    verify,
    write_orphan_note,
)
from ftrun.errors import describe
from ftrun.common.protocol import MsgType


class RankCheckpoints:
    """This rank's checkpoint writing and loading.

    Args:
        directory: ``--checkpoint_dir`` (None: no periodic checkpoints, no dying gasp).
        replica_groups: the job's replica groups (lists of ranks), for the shard numbers.
        send: sends a message to the supervisor (``send(MsgType, **fields)``): ``saved`` when a
            shard is written, ``error`` when writing failed.
        registry: the rank's :class:`ftrun.rank.registry.StateRegistry`; its sharded models and their
            optimizers make the checkpoints sliced (:class:`ftrun.rank.dcp.ShardedState`). None: the
            shard file holds everything.

    :meth:`bind` gives it the rank (late for a hot spare).
    """

    def __init__(self, directory: str | None, replica_groups: Sequence[Sequence[int]],
                 send: Callable[..., None], registry: Any = None) -> None:
        self.directory = directory
        self.replica_groups = [list(g) for g in replica_groups]
        self.send = send
        self.registry = registry
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

    def _sharded(self) -> Any:
        """The registry's sharded state (:class:`ftrun.rank.dcp.ShardedState`), or None when no model
        is sharded (torch.distributed.checkpoint is then not imported)."""
        if self.registry is None:
            return None
        from ftrun.rank.sharding import LocalShards

        if not any(isinstance(o, LocalShards) for _, o in self.registry.items()):
            return None
        from ftrun.rank.dcp import ShardedState

        return ShardedState(self.registry)

    def resume(self, directory: Path) -> dict[str, Any]:
        """Resume from the checkpoint in ``directory``: returns this rank's ``{name: state}`` for
        ``registry.load``. From a sliced checkpoint (:mod:`ftrun.rank.dcp`) the sharded models and
        their optimizers are loaded here, in place, resharded onto this job's mesh with no
        collective (so a rank may roll back alone), and are not in what is returned. When the
        checkpoint was written by another world size or other replica groups, the rest comes
        from shard 0 (replica state is the same on every replica) less the per-rank state
        (kind ``rank``: data positions, RNG streams, buffers), which is not carried (said on the
        rank's log).

        Raises:
            CheckpointError: the shard (or a DCP file this rank reads) does not load or verify
                (:func:`~ftrun.common.checkpoint.load_shard`, :func:`ftrun.rank.dcp.load_sliced`); the
                checkpoint is then marked unusable (:func:`~ftrun.common.checkpoint.mark_unusable`), so
                the whole-job restart that follows starts from the next older one.
            RuntimeError: a sliced checkpoint verifies but does not fit this job's models
                (another model); the checkpoint is not marked.
        """
        try:
            manifest = verify(directory, checksums=False)
            if not manifest.sliced:
                return load_shard(manifest, self.shard)
            return self._resume_sliced(manifest)
        except CheckpointError as err:
            mark_unusable(directory, err)
            raise

    def _resume_sliced(self, manifest: Manifest) -> dict[str, Any]:
        from ftrun.rank.dcp import load_sliced

        world = sum(len(g) for g in self.replica_groups)
        same = manifest.world_size == world and manifest.replica_groups == canonical_groups(self.replica_groups)
        state = load_shard(manifest, self.shard if same else 0)
        if not same:
            kinds = self.registry.kinds if self.registry is not None else {}
            dropped = sorted(n for n in state if kinds.get(n) == "rank")
            state = {n: v for n, v in state.items() if n not in dropped}
            print(f"ftrun: rank {self.rank}: checkpoint {manifest.directory} was written by {manifest.world_size} ranks "
                  f"in replica groups {manifest.replica_groups}: its sharded state is resharded onto this mesh, the rest "
                  f"comes from shard 0" + (f"; per-rank state not carried: {', '.join(dropped)}" if dropped else ""),
                  flush=True)
        sharded = self._sharded()
        if sharded is None:
            raise RuntimeError(f"{manifest.directory}: a sliced (DCP) checkpoint, and this job has no sharded model to load it into")
        checked: set[str] = set()

        def check(name: str) -> None:
            if name not in checked:
                check_file(manifest.directory, manifest.dcp_file(name))
                checked.add(name)

        for part in manifest.dcp_parts():
            check(part.split("/", 1)[1])
        target = sharded.state_dict()
        load_sliced(manifest.directory, target, manifest.dcp_parts(), check)
        sharded.load(target)
        return {n: v for n, v in state.items() if n not in target}

    def save_periodic(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Snapshot ``state()`` (the state of committed ``step``) and write it in the background, if
        this rank is its group's writer and a directory is set; ``saved`` or ``error`` follows. A
        sharded job's models and optimizers are snapshotted and written in DCP's format
        (:mod:`ftrun.rank.dcp`), the rest in the shard file."""
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

        sharded = self._sharded()
        if sharded is None:
            self._async.save(step, state(), on_done=done)
            return
        from ftrun.rank.dcp import save_part

        def slices() -> Callable[[Path], list[ShardInfo]]:
            copy = sharded.snapshot()
            return lambda directory: save_part(directory, shard, copy)

        self._async.save(step, self._without(state(), sharded), on_done=done, slices=slices)

    @staticmethod
    def _without(state: dict[str, Any], sharded: Any) -> dict[str, Any]:
        """``state`` less what goes in DCP's format."""
        names = set(sharded.names())
        return {n: v for n, v in state.items() if n not in names}

    def _save_now(self, directory: Path, shard: int, state: dict[str, Any]) -> ShardInfo:
        """Write ``shard`` of ``state`` into ``directory`` now (a dying gasp): the shard file, and a
        sharded job's DCP slice of its live models and optimizers."""
        sharded = self._sharded()
        if sharded is None:
            return save_shard(directory, shard, state)
        from ftrun.rank.dcp import save_part

        if self._async is not None:  # DCP writes its data files in place: never two writers of one file
            try:
                self._async.wait()
            except Exception:  # noqa: BLE001  already reported by that write's own error message
                pass

        info = save_shard(directory, shard, self._without(state, sharded))
        return ShardInfo(info.file, info.bytes, info.sha256, tuple(save_part(directory, shard, sharded.state_dict())))

    def save_requested(self, request: Any, committed: int, state: dict[str, Any]) -> None:
        """Write the shard the supervisor's ``save`` message names (a dying gasp, TTP), at a safe
        point where this rank holds exactly committed ``committed``; ``saved`` or ``error`` follows."""
        started = time.monotonic()
        failure: str | None = None
        try:
            if committed != request["step"]:
                raise RuntimeError(f"this rank holds step {committed}, not {request['step']}")
            info = self._save_now(Path(request["directory"]), request["shard"], state)
        except Exception as err:
            failure = describe(err)
        if failure is not None:
            self.send(MsgType.ERROR, reason=f"dying-gasp checkpoint failed: {failure}")
            return
        self.send(MsgType.SAVED, step=request["step"], shard=request["shard"], info=info.to_json(),
                  seconds=time.monotonic() - started, torch_version=torch.__version__, reason=request["reason"])

    def save_orphaned(self, committed: int, state: Callable[[], dict[str, Any]], world_size: int) -> str:
        """The supervisor is gone: write this group's shard of committed ``committed`` with an orphan
        note (:func:`ftrun.common.checkpoint.write_orphan_note`) if this rank is the writer. Returns what
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
            info = self._save_now(directory, self.shard, state())
            write_orphan_note(directory, self.shard, info, world_size, self.replica_groups, torch.__version__)
        except Exception as err:
            return f"; its dying-gasp checkpoint failed: {describe(err)}"
        return f"; wrote shard {self.shard} of step {committed} to {directory}"

    def close(self) -> None:
        """Wait for the periodic checkpoint being written, if any."""
        if self._async is not None:
            self._async.close()

"""Checkpoints of sharded models in torch.distributed.checkpoint's (DCP's) format, written with no
collective and resumed onto another world size or mesh shape.

ftrun writes checkpoints in the background and while ranks may be dying (a dying gasp is written by
the survivors of a fault), so no write may need the job's process group: ``dcp.save`` over the
group plans the checkpoint with collectives (a gather of every rank's plan, a gather of the written
chunks for the global ``.metadata``) and hangs on a dead rank. Instead:

- **Each writer saves its own slice, alone.** One replica of each replica group (the group's
  writer, :class:`ftrun.rank.shards.RankCheckpoints`) runs ``dcp.save(..., no_dist=True,
  use_collectives=False)`` on its sharded state (FQN-keyed DTensors from
  ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=False``, which run
  no collective for FSDP2, HSDP and tensor parallelism: checked in torch 2.13's source, and by the
  dying-gasp test, whose writers save while a peer is dead). DTensors carry their global
  shape and their slice's offsets (``compute_local_shape_and_global_offset``, from the mesh
  coordinates alone), so the writer's plan names its chunks in global coordinates. Its files, in
  the step directory's ``dcp/`` folder, are DCP's own names for a rank that writes without
  collectives: ``__<k>_0.distcp`` (the data) and ``__<k>.metadata`` (the chunks it wrote), ``k``
  being its shard number (:func:`part_files`).
- **The global metadata is merged at load time** (:func:`merge_metadata`): the union of the
  writers' chunks, one copy of a chunk several writers hold (a parameter replicated over a
  tensor-parallel dimension is written by each of its writers; the first is kept), checked to cover
  every tensor exactly once. The supervisor, which completes the checkpoint, does not import
  torch, so it cannot merge the parts; a rank that loads merges them in memory
  (:class:`MergedReader`), and :func:`write_metadata` writes the merged ``dcp/.metadata`` for
  ``dcp.load`` outside ftrun.
- **Loading reshards.** Each rank plans its own reads against the merged metadata
  (``dcp.load(..., no_dist=True)``: no collective either, so a rank rolled back in place while its
  peers are elsewhere loads alone): its slice of the new mesh is read from whichever writers' files
  hold it. A checkpoint of a 2x2 HSDP job resumes on a 1x2 mesh, a 1x4 one, or 2x2.

Everything else a rank registered (a scheduler, data positions, RNG streams, model buffers) goes in
the shard file as before (:func:`ftrun.common.checkpoint.save_shard`); on another world size or other
replica groups a rank takes shard 0's, less the per-rank state, which is not carried
(:meth:`ftrun.rank.shards.RankCheckpoints.resume`). Every file is in the manifest with its size and
SHA-256 (:class:`ftrun.common.checkpoint.ShardInfo`), checked before it is read (the metadata parts are
pickles DCP wrote: unpickled only once their SHA-256 matched).

Measured on torch 2.13 CPU with gloo: ``tests/test_fsdp_checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ftrun.common.checkpoint import DCP_DIR, CheckpointError, ShardInfo, file_info
from ftrun.rank.sharding import LocalOptimizerState, LocalShards

METADATA = ".metadata"  # the merged metadata's name (DCP's global one)


def part_files(part: int) -> tuple[str, str]:
    """(data file, metadata file) names that writer ``part`` leaves in ``dcp/``: DCP's names for a
    rank that writes without collectives (``__<part>_0.distcp``, ``__<part>.metadata``)."""
    return f"__{int(part)}_0.distcp", f"__{int(part)}{METADATA}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it saves "in a single process" under ``no_dist``: that is the design here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class ShardedState:
    """The sharded part of a rank's registered state, in DCP's form.

    The registry's :class:`~ftrun.rank.sharding.LocalShards` objects (models) and the
    :class:`~ftrun.rank.sharding.LocalOptimizerState` objects whose optimizer steps parameters of one
    of those models are checkpointed through DCP under their registered names; everything else
    stays in the shard file.

    Args:
        registry: the rank's :class:`ftrun.rank.registry.StateRegistry` (read each time: objects may be
            registered after this is built).
    """

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def _entries(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        models = {n: o.model for n, o in self.registry.items() if isinstance(o, LocalShards)}
        for model in models.values():
            # A forward that failed midway (a dying gasp, a rollback) leaves FSDP's unsharded
            # parameters registered in place of the sharded ones; FSDP's own state_dict pre-hook
            # registers the sharded ones again (no collective), so the optimizer's parameters are found.
            model.state_dict()
        out: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]] = {n: (m, None) for n, m in models.items()}
        for name, obj in self.registry.items():
            if not isinstance(obj, LocalOptimizerState):
                continue
            params = {id(p) for g in obj.optimizer.param_groups for p in g["params"]}
            owner = next((m for m in models.values() if params <= {id(p) for p in m.parameters()}), None)
            if owner is not None:
                out[name] = (owner, obj.optimizer)
        return out

    def names(self) -> list[str]:
        """The registered names checkpointed through DCP (empty: not a sharded job)."""
        return list(self._entries())

    def state_dict(self) -> dict[str, Any]:
        """``{name: FQN-keyed state}``: a model's ``get_model_state_dict`` and an optimizer's
        ``get_optimizer_state_dict`` (``full_state_dict=False``: this rank's DTensors, no
        collective). The tensors are the live ones (an optimizer with no state yet gets it from a
        step with a learning rate of 0, torch's own initialisation)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=False)
        out: dict[str, Any] = {}
        for name, (model, optimizer) in self._entries().items():
            out[name] = (get_model_state_dict(model, options=options) if optimizer is None
                         else get_optimizer_state_dict(model, optimizer, options=options))
        return out

    def snapshot(self) -> dict[str, Any]:
        """A copy of :meth:`state_dict` that training may go on changing the original of (each
        DTensor's local tensor copied, wrapped again on its mesh and placements; no collective)."""
        return _copy(self.state_dict())

    def load(self, state: Mapping[str, Any]) -> None:
        """Put ``state`` (as :meth:`state_dict` gives it, loaded) into the models and optimizers."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=False)
        for name, (model, optimizer) in self._entries().items():
            if name not in state:
                continue
            if optimizer is None:
                set_model_state_dict(model, state[name], options=options)
            else:
                set_optimizer_state_dict(model, optimizer, state[name], options=options)


def _copy(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = obj.to_local().detach().clone()
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(v) for v in obj)
    return obj


def _part_writer(path: Path, part: int) -> Any:
    """A ``FileSystemWriter`` into ``path`` as writer ``part`` with no collective (DCP's rank-local
    files, ``rank`` being ``part``), which records the data files it wrote."""
    from torch.distributed.checkpoint import FileSystemWriter

    class PartWriter(FileSystemWriter):
        files: list[str] = []

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, rank=int(part), use_collectives=False)

        def finish(self, metadata: Any, results: Any) -> None:
            self.files = sorted({r.storage_data.relative_path for rs in results for r in rs})
            super().finish(metadata, results)

    return PartWriter(path, overwrite=True)


def save_part(directory: str | Path, part: int, state: Mapping[str, Any]) -> list[ShardInfo]:
    """Write writer ``part``'s slice of ``state`` (:meth:`ShardedState.state_dict` or its
    :meth:`~ShardedState.snapshot`) into ``<directory>/dcp/``, with no collective.

    Args:
        directory: the step directory (:func:`ftrun.common.checkpoint.step_dir`).
        part: the writer's shard number (its replica group's index).
        state: ``{name: FQN-keyed state}`` of DTensors, tensors and primitives.

    Returns:
        one :class:`ShardInfo` per file written (``dcp/...``, bytes, SHA-256), metadata last.

    Raises:
        OSError: a file cannot be written (disk full, permissions).
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    target = directory / DCP_DIR
    target.mkdir(parents=True, exist_ok=True)
    writer = _part_writer(target, part)
    with _quiet():
        dcp.save(dict(state), storage_writer=writer, no_dist=True, use_collectives=False)
    names = list(writer.files) + [part_files(part)[1]]
    return [file_info(directory, f"{DCP_DIR}/{name}") for name in names]


# ---------------------------------------------------------------------------------- metadata merge
def merge_metadata(parts: Sequence[Any]) -> Any:
    """One DCP ``Metadata`` out of the writers' parts: the union of their chunks (one copy of a
    chunk at an offset several parts hold; the first part's is kept), their bytes entries and
    planner data.

    Args:
        parts: each writer's ``torch.distributed.checkpoint.metadata.Metadata``
            (``__<k>.metadata``), at least one.

    Returns:
        the merged ``Metadata``, whose ``storage_data`` names each chunk's file relative to ``dcp/``.

    Raises:
        ValueError: no part; parts disagree on a tensor's size, dtype or kind; a chunk lies outside
            its tensor or overlaps another one; or the chunks do not cover a tensor (a writer's
            part is missing), naming the tensor.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

    if not parts:
        raise ValueError("no metadata part to merge")
    merged: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}
    for number, part in enumerate(parts):
        for fqn, md in part.state_dict_metadata.items():
            have = merged.get(fqn)
            if isinstance(md, TensorStorageMetadata):
                if have is None:
                    have = merged[fqn] = TensorStorageMetadata(md.properties, md.size, [])
                elif not isinstance(have, TensorStorageMetadata) or have.size != md.size or have.properties.dtype != md.properties.dtype:
                    raise ValueError(f"{fqn}: part {number} holds {_kind(md)}, an earlier part {_kind(have)}")
                for chunk in md.chunks:
                    key = tuple(chunk.offsets)
                    if key in seen.setdefault(fqn, set()):
                        continue
                    seen[fqn].add(key)
                    have.chunks.append(chunk)
                    storage[MetadataIndex(fqn, chunk.offsets)] = part.storage_data[MetadataIndex(fqn, chunk.offsets)]
            elif isinstance(md, BytesStorageMetadata):
                if have is None:
                    merged[fqn] = md
                    storage[MetadataIndex(fqn)] = part.storage_data[MetadataIndex(fqn)]
                elif not isinstance(have, BytesStorageMetadata):
                    raise ValueError(f"{fqn}: part {number} holds bytes, an earlier part {_kind(have)}")
            else:
                raise ValueError(f"{fqn}: part {number} holds {type(md).__name__}, which ftrun does not merge")
        planner.update(part.planner_data or {})
    for fqn, md in merged.items():
        if isinstance(md, TensorStorageMetadata):
            check_coverage(fqn, tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    return Metadata(state_dict_metadata=merged, planner_data=planner, storage_data=storage,
                    version=getattr(parts[0], "version", None))


def _kind(md: Any) -> str:
    size = getattr(md, "size", None)
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    return f"a tensor of size {tuple(size)} and {dtype}" if size is not None else type(md).__name__


def check_coverage(fqn: str, size: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Check that ``chunks`` (``(offsets, sizes)`` each) tile a tensor of ``size`` exactly: each inside
    it, no two overlapping, their elements adding up to the tensor's.

    Raises:
        ValueError: naming ``fqn`` and the first problem found.
    """
    total = 0
    boxes = []
    for offsets, sizes in chunks:
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
            raise ValueError(f"{fqn}: a chunk at {list(offsets)} of {list(sizes)} lies outside its size {list(size)}")
        if math.prod(sizes) == 0:
            continue
        for other_offsets, other_sizes in boxes:
            if all(o < p + m and p < o + n for o, n, p, m in zip(offsets, sizes, other_offsets, other_sizes)):
                raise ValueError(f"{fqn}: the chunks at {list(offsets)} and {list(other_offsets)} overlap")
        boxes.append((offsets, sizes))
        total += math.prod(sizes)
    if total != math.prod(size):
        raise ValueError(f"{fqn}: the slices hold {total} of its {math.prod(size)} elements "
                         f"(a writer's part is missing)")


def read_part(path: Path) -> Any:
    """A writer's ``__<k>.metadata`` (a pickle DCP wrote: read only after its SHA-256 matched the
    manifest's).

    Raises:
        CheckpointError: it does not unpickle to DCP ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f)
    except FileNotFoundError:
        raise CheckpointError(path, "missing DCP metadata part") from None
    except Exception as err:
        raise CheckpointError(path, f"is not DCP metadata ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(path, f"is not DCP metadata (a {type(metadata).__name__})")
    return metadata


def merged_metadata(directory: str | Path, parts: Sequence[str]) -> Any:
    """The merged metadata of the parts (``dcp/__<k>.metadata`` paths relative to ``directory``).

    Raises:
        CheckpointError: a part does not read, or the parts do not merge (:func:`merge_metadata`)."""
    directory = Path(directory)
    read = [read_part(directory / p) for p in parts]
    try:
        return merge_metadata(read)
    except ValueError as err:
        raise CheckpointError(directory / DCP_DIR, f"slices do not make a checkpoint: {err}") from None


def _reader(path: Path, metadata: Any, check: Callable[[str], None] | None) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta(load_id=self.load_id)
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            if check is not None:
                for name in sorted({self.storage_data[i.storage_index].relative_path for i in plan.items}):
                    check(name)
            return super().read_data(plan, planner)

    return Reader(path)


class MergedReader:
    """A DCP storage reader over a sliced checkpoint's ``dcp/`` folder whose metadata is the
    writers' parts merged (:func:`merged_metadata`): ``dcp.load(state, storage_reader=
    MergedReader(step_dir).reader)``, with no ``.metadata`` on disk.

    Args:
        directory: the step directory.
        parts: the metadata parts, relative to ``directory`` (default: those its manifest names,
            once the checkpoint verified with its checksums).
        check: called with each data file's name (relative to ``dcp/``) before it is read (ftrun
            checks its size and SHA-256 against the manifest there).

    Raises:
        CheckpointError: as :func:`merged_metadata`; without ``parts``, the manifest does not verify.
    """

    def __init__(self, directory: str | Path, parts: Sequence[str] | None = None,
                 check: Callable[[str], None] | None = None) -> None:
        directory = Path(directory)
        if parts is None:
            from ftrun.common.checkpoint import verify

            parts = verify(directory).dcp_parts()  # every file's SHA-256 too
        self.metadata = merged_metadata(directory, parts)
        self.reader = _reader(directory / DCP_DIR, self.metadata, check)


def load_sliced(directory: str | Path, state: dict[str, Any], parts: Sequence[str],
                check: Callable[[str], None] | None = None) -> None:
    """Read ``state`` (:meth:`ShardedState.state_dict`, DTensors of this rank's mesh) in place from
    the sliced checkpoint in ``directory``, resharding, with no collective.

    Raises:
        CheckpointError: the parts do not merge, or a file fails ``check``.
        RuntimeError: DCP cannot read a tensor ``state`` names (a model of another shape, a name
            the checkpoint lacks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException as DCPException  # a BaseException

    found: list[CheckpointError] = []  # DCP wraps what read_data raises: the damage is kept here

    def checked(name: str) -> None:
        try:
            if check is not None:
                check(name)
        except CheckpointError as err:
            found.append(err)
            raise

    reader = MergedReader(directory, parts, checked).reader
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, DCPException) as err:
        if found:
            raise found[0] from None
        # The files verified: not damage but another model's checkpoint.
        text = str(err).strip()
        # DCP wraps the planner's error in a CheckpointException holding its traceback: its last line.
        first = next((line for line in reversed(text.splitlines()) if "Error:" in line), text.splitlines()[0] if text else "")
        raise RuntimeError(f"{Path(directory) / DCP_DIR}: does not load into this job's models ({type(err).__name__}: "
                           f"{first.strip()})") from None


def write_metadata(directory: str | Path) -> Path:
    """Write the merged ``dcp/.metadata`` of the sliced checkpoint in step directory ``directory``
    (its manifest's parts), so that plain ``dcp.load(state, checkpoint_id=<directory>/dcp)`` reads it
    outside ftrun. Atomic. Returns its path.

    Raises:
        CheckpointError: the checkpoint does not verify or is not sliced, or its parts do not merge.
        OSError: the file cannot be written."""
    from ftrun.common.checkpoint import write_atomically, verify

    manifest = verify(directory)
    if not manifest.sliced:
        raise CheckpointError(manifest.path, "is not a sliced (DCP) checkpoint")
    metadata = merged_metadata(manifest.directory, manifest.dcp_parts())
    final = manifest.directory / DCP_DIR / METADATA
    write_atomically(final, lambda f: pickle.dump(metadata, f))
    return final

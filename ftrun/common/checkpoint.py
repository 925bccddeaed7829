"""Checkpoints on disk: TTP dying-gasp saves, periodic asynchronous saves, and resume.

Layout (one directory per committed step, one file per shard, the manifest last)::

    <root>/step_000001200/shard_0.pt
    <root>/step_000001200/shard_1.pt
    <root>/step_000001200/manifest.json

A *shard* is a replica group (docs/recovery.md): ranks holding identical state. Shard ``k`` is the
``k``-th replica group sorted by its smallest rank (:func:`canonical_groups`); one live replica
of each shard writes that shard's file with :func:`save_shard`, which returns a :class:`ShardInfo`
(size and SHA-256). Once every shard file is reported written, a single writer (the supervisor,
which does not import torch, or rank 0) writes ``manifest.json`` with :func:`write_manifest`::

    {"format": "ftrun-checkpoint", "version": 1, "step": 1200, "world_size": 4,
     "replica_groups": [[0, 2], [1, 3]],
     "shards": {"0": {"file": "shard_0.pt", "bytes": 123, "sha256": "..."}, "1": {...}},
     "ftrun_version": "0.1.0", "torch_version": "2.13.0+cpu", "created": 1700000000.0,
     "reason": "periodic", "extra": {}}

Every file is written atomically: a temporary name in the same directory, ``fsync``,
``os.replace``, then ``fsync`` of the directory. A step directory without a manifest is therefore
an incomplete checkpoint (a writer died, or the job died before every shard was in), and a
manifest is only ever written after the files it names. :func:`verify` checks sizes and
checksums; :func:`find_latest` returns the newest checkpoint that verifies, reporting each one it
skips; :func:`resolve_resume` implements ``--resume {auto,none,PATH}``; :func:`prune` keeps the
newest ``K`` (``--keep_checkpoints K``).

Shard files are ``torch.save`` archives loaded back with ``torch.load(weights_only=True)``: only
tensors, containers and primitives, never arbitrary pickles (a file that holds anything else is
refused with :class:`CheckpointError`, and nothing in it is executed). Numpy arrays, which
``weights_only`` does not accept, are stored as their raw bytes in a ``uint8`` tensor with their
dtype and shape, and come back as numpy arrays, bit for bit (so RNG states round-trip exactly).

Periodic checkpoints (MindIO TTP's and TorchFT's idea of overlapping saves with training):
:class:`AsyncCheckpointer` copies the state at a step boundary (:func:`snapshot`: the only part
that blocks training) and writes it from one background thread.

This module imports neither torch nor numpy at import time: the supervisor uses
:func:`write_manifest`, :func:`verify`, :func:`find_latest`, :func:`resolve_resume` and
:func:`prune` without paying torch's import (about 1.2 s on a 2-core machine, measured).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

FORMAT = "ftrun-checkpoint"
VERSION = 1
SLICED_VERSION = 2  # a manifest whose shards also hold DCP files (ftrun.rank.dcp); an older ftrun refuses it
DCP_DIR = "dcp"  # a sliced checkpoint's DCP folder inside the step directory
MANIFEST = "manifest.json"
UNUSABLE_NOTE = "unusable.json"  # a shard of this checkpoint failed to load (mark_unusable)
STEP_DIGITS = 9
_STEP_RE = re.compile(r"^step_(\d+)$")
_HASH_BLOCK = 8 << 20  # bytes read at a time when checksumming a file


class CheckpointError(ValueError):
    """A checkpoint cannot be used. ``str()`` is one line naming the file and the problem.

    Attributes:
        path: the file (or directory) at fault.
        problem: what is wrong with it, without the path.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class ShardInfo:
    """One shard file as the manifest records it.

    Attributes:
        file: the file's name inside the step directory (``shard_<k>.pt``; ``dcp/<name>`` for a
            file of a sliced checkpoint's DCP folder).
        bytes: its size in bytes.
        sha256: the hex SHA-256 of its contents.
        files: a sliced checkpoint's DCP files this shard's writer wrote (its data files, then its
            metadata part, :mod:`ftrun.rank.dcp`), each a :class:`ShardInfo`; empty otherwise.
    """

    file: str
    bytes: int
    sha256: str
    files: tuple["ShardInfo", ...] = ()

    def to_json(self) -> dict[str, Any]:
        """``{"file": ..., "bytes": ..., "sha256": ...}`` (what a writer reports, and the manifest
        holds), with ``"dcp": [...]`` (the :attr:`files`) when there are any."""
        out: dict[str, Any] = {"file": self.file, "bytes": self.bytes, "sha256": self.sha256}
        if self.files:
            out["dcp"] = [f.to_json() for f in self.files]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], under: str | None = None) -> "ShardInfo":
        """Inverse of :meth:`to_json`. ``under``: the folder the file must be directly in (``dcp``),
        None for the step directory itself.

        Raises:
            ValueError: a field is missing or has the wrong type, or ``file`` is not a plain name
                (``under/<plain name>`` with ``under``).
        """
        try:
            file, size, digest = data["file"], data["bytes"], data["sha256"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"shard entry {data!r} lacks {e}") from None
        name = file.removeprefix(f"{under}/") if isinstance(file, str) and under is not None else file
        if (not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..")
                or (under is not None and name == file)):
            where = f"{under}/<name>" if under is not None else "a plain file name"
            raise ValueError(f"shard file {file!r} is not {where}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"shard size {size!r} is not a byte count")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"shard checksum {digest!r} is not a hex SHA-256")
        sliced = data.get("dcp") if isinstance(data, Mapping) else None
        if sliced is not None and (under is not None or not isinstance(sliced, list) or not sliced):
            raise ValueError(f"shard entry's dcp files {sliced!r} are not a list of files")
        files = tuple(cls.from_json(f, under=DCP_DIR) for f in sliced or ())
        return cls(file, size, digest, files)


@dataclass
class Manifest:
    """A checkpoint's manifest, as read by :func:`verify`.

    Attributes:
        directory: the step directory holding the manifest and shard files.
        step: the committed step the checkpoint holds (training resumes at ``step + 1``).
        world_size: ranks in the job that wrote it.
        replica_groups: the canonical replica groups (:func:`canonical_groups`); shard ``k`` is
            ``replica_groups[k]``.
        shards: ``{k: ShardInfo}`` for ``k`` in ``range(len(replica_groups))``.
        ftrun_version, torch_version: versions of the writers ("unknown" if not known).
        created: Unix time (seconds) the manifest was written.
        reason: why it was written ("periodic", "ttp", ...).
        extra: free-form JSON the writer added.
    """

    directory: Path
    step: int
    world_size: int
    replica_groups: list[list[int]]
    shards: dict[int, ShardInfo]
    ftrun_version: str = "unknown"
    torch_version: str = "unknown"
    created: float = 0.0
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The manifest file."""
        return self.directory / MANIFEST

    def shard_path(self, shard: int) -> Path:
        """The file of shard ``shard``.

        Raises:
            CheckpointError: the checkpoint has no such shard.
        """
        if shard not in self.shards:
            raise CheckpointError(self.path, f"has no shard {shard} (it has shards 0..{len(self.shards) - 1})")
        return self.directory / self.shards[shard].file

    @property
    def sliced(self) -> bool:
        """Whether the checkpoint's sharded models are in DCP's format (:mod:`ftrun.rank.dcp`): it
        resumes onto another world size or mesh shape."""
        return any(info.files for info in self.shards.values())

    def dcp_parts(self) -> list[str]:
        """The writers' DCP metadata parts (``dcp/__<k>.metadata``), by shard."""
        return [f.file for _, info in sorted(self.shards.items()) for f in info.files if f.file.endswith(".metadata")]

    def dcp_file(self, name: str) -> ShardInfo:
        """The manifest's record of DCP file ``name`` (relative to ``dcp/``).

        Raises:
            CheckpointError: the manifest names no such file."""
        for info in self.shards.values():
            for f in info.files:
                if f.file == f"{DCP_DIR}/{name}":
                    return f
        raise CheckpointError(self.directory / DCP_DIR / name, "is not in the manifest")

    @classmethod
    def from_json(cls, data: Mapping[str, Any], directory: Path) -> "Manifest":
        """Inverse of :meth:`to_json`, for the checkpoint in ``directory``; ``data`` is of a format
        and version this ftrun reads (:func:`verify` checked them).

        Raises:
            KeyError, TypeError, ValueError: a field is missing, has the wrong type, or disagrees
                with another (shards and replica groups; DCP files and the version).
        """
        version = data.get("version")
        step, world_size = data["step"], data["world_size"]
        if not isinstance(step, int) or not isinstance(world_size, int) or step < 0 or world_size < 1:
            raise ValueError(f"step {step!r} / world_size {world_size!r} are not valid")
        groups = canonical_groups(data["replica_groups"])
        shards = {int(k): ShardInfo.from_json(v) for k, v in dict(data["shards"]).items()}
        if sorted(shards) != list(range(len(groups))):
            raise ValueError(f"shards {sorted(shards)} do not match {len(groups)} replica groups")
        if any(bool(info.files) != (version == SLICED_VERSION) for info in shards.values()):
            raise ValueError(f"a version {version} manifest whose shards {'lack' if version == SLICED_VERSION else 'hold'} DCP files")
        return cls(
            directory=directory,
            step=step,
            world_size=world_size,
            replica_groups=groups,
            shards=shards,
            ftrun_version=str(data.get("ftrun_version", "unknown")),
            torch_version=str(data.get("torch_version", "unknown")),
            created=float(data.get("created", 0.0)),
            reason=str(data.get("reason", "")),
            extra=dict(data.get("extra") or {}),
        )

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON object (what ``manifest.json`` holds)."""
        return {
            "format": FORMAT,
            "version": SLICED_VERSION if self.sliced else VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "replica_groups": self.replica_groups,
            "shards": {str(k): info.to_json() for k, info in sorted(self.shards.items())},
            "ftrun_version": self.ftrun_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "reason": self.reason,
            "extra": self.extra,
        }


# ---------------------------------------------------------------------------------------- naming
def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """``<root>/step_<step:09d>``: the directory of the checkpoint of committed step ``step``."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(root) / f"step_{step:0{STEP_DIGITS}d}"


def shard_file(shard: int) -> str:
    """``shard_<shard>.pt``: the file name of shard ``shard`` inside a step directory."""
    if shard < 0:
        raise ValueError(f"shard index must be >= 0, got {shard}")
    return f"shard_{shard}.pt"


def canonical_groups(replica_groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Replica groups with each group sorted and the groups sorted by smallest rank.

    Shard ``k`` of a checkpoint is ``canonical_groups(groups)[k]``.

    Raises:
        ValueError: an empty group, or a rank in two groups.
    """
    groups = [sorted(int(r) for r in g) for g in replica_groups]
    if any(not g for g in groups):
        raise ValueError(f"replica groups {replica_groups!r} contain an empty group")
    ranks = [r for g in groups for r in g]
    if len(ranks) != len(set(ranks)):
        raise ValueError(f"replica groups {replica_groups!r} name a rank twice")
    return sorted(groups, key=lambda g: g[0])


def shard_of_rank(rank: int, replica_groups: Sequence[Sequence[int]]) -> int:
    """The shard index of ``rank``'s replica group.

    Raises:
        ValueError: no group holds ``rank``.
    """
    for k, group in enumerate(canonical_groups(replica_groups)):
        if rank in group:
            return k
    raise ValueError(f"replica groups {replica_groups!r} do not contain rank {rank}")


def _step_of(path: Path) -> int | None:
    match = _STEP_RE.match(path.name)
    return int(match.group(1)) if match else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step_<n>`` directory under ``root``, newest first."""
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(s, p) for p in entries if (s := _step_of(p)) is not None and p.is_dir()]
    return sorted(found, key=lambda sp: sp[0], reverse=True)


# ------------------------------------------------------------------------------- atomic writes
def _fsync_dir(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable. A no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _make_dir(directory: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of each directory it creates."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        _fsync_dir(d.parent)


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def write_atomically(final: Path, fill: Callable[[Any], Any]) -> Any:
    """Write ``final`` through a temporary name in its directory: ``fill(binary file)``, flush,
    fsync, rename into place, fsync the directory. Returns what ``fill`` returned; on any error the
    temporary file is removed and ``final`` is untouched."""
    tmp = _temp_name(final)
    try:
        with open(tmp, "wb") as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)
    return result


class _HashingWriter:
    """A write-only file object that hashes and counts what goes through it."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None  # the file's first error (torch's serializer hides it)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)  # releases the GIL for large buffers
        self.bytes += view.nbytes
        try:
            self._f.write(view)
        except OSError as err:
            self.error = self.error or err
            raise
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _sha256_file(path: Path) -> tuple[int, str]:
    """(size in bytes, hex SHA-256) of a file, read in blocks."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def file_info(directory: str | os.PathLike[str], name: str) -> ShardInfo:
    """A :class:`ShardInfo` of file ``name`` (relative to step directory ``directory``), read back
    for its size and SHA-256 (for files another library wrote: DCP's, :mod:`ftrun.rank.dcp`).

    Raises:
        OSError: the file cannot be read."""
    size, digest = _sha256_file(Path(directory) / name)
    return ShardInfo(name, size, digest)


def check_file(directory: str | os.PathLike[str], info: ShardInfo) -> None:
    """Check the size and SHA-256 of file ``info.file`` in step directory ``directory``.

    Raises:
        CheckpointError: missing, another size, or another checksum (naming the file)."""
    _check_shard(Path(directory) / info.file, info, checksum=True)


# ---------------------------------------------------------------------- state encoding (save)
# One codec for checkpoints and transfers (ftrun.common.codec); the names this module has always used.
from ftrun.common.codec import SCALARS as _SCALARS  # noqa: E402
from ftrun.common.codec import check_key as _check_key  # noqa: E402
from ftrun.common.codec import decode as _decode  # noqa: E402
from ftrun.common.codec import encode as _encode  # noqa: E402
from ftrun.common.codec import key_path as _key_path  # noqa: E402
from ftrun.common.codec import new_dict as _new_dict  # noqa: E402


# ------------------------------------------------------------------------------- shard files
def save_shard(directory: str | os.PathLike[str], shard: int, state: Mapping[str, Any]) -> ShardInfo:
    """Write one shard's state to ``<directory>/shard_<shard>.pt``, atomically.

    The state is validated first (nothing is written if it holds something that
    ``torch.load(weights_only=True)`` would refuse), then saved with ``torch.save`` to a temporary
    name in the same directory while its SHA-256 is computed, fsynced, renamed into place, and the
    directory fsynced. The directory is created if needed. Synchronous: use
    :class:`AsyncCheckpointer` to overlap the write with training; call it directly for a TTP
    dying-gasp save.

    Args:
        directory: the step directory (:func:`step_dir`).
        shard: the shard index (:func:`shard_of_rank`).
        state: nested dicts/lists/tuples of tensors (any device; loaded back on CPU), numpy arrays
            and primitives, e.g. ``Worker.state_dict()``.

    Returns:
        the :class:`ShardInfo` to report to the manifest's writer.

    Raises:
        TypeError: the state holds an object that is not a tensor, array, container or primitive
            (the message names its place in the state).
        OSError: the directory or file cannot be written (permissions, disk full).
    """
    import torch

    directory = Path(directory)
    payload = {"format": FORMAT, "version": VERSION, "shard": int(shard), "state": _encode(state)}
    final = directory / shard_file(shard)
    _make_dir(directory)

    def fill(f: Any) -> _HashingWriter:
        writer = _HashingWriter(f)
        try:
            torch.save(payload, writer)
        except RuntimeError as err:
            # torch's serializer turns the file's error into "unexpected pos N vs M": the disk's
            # own error (ENOSPC: no space left) is what the user needs to read.
            if writer.error is not None:
                raise writer.error from err
            raise
        return writer

    try:
        writer = write_atomically(final, fill)
    except OSError:
        with contextlib.suppress(OSError):
            directory.rmdir()  # left empty: no step directory without a shard in it
        raise
    return ShardInfo(final.name, writer.bytes, writer.hexdigest())


def _load_error(err: BaseException) -> str:
    """One line out of torch.load's multi-line refusal."""
    text = str(err)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return "holds objects that are not plain tensors and primitives, refused (" + line.strip().removeprefix("WeightsUnpickler error:").strip() + ")"
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"cannot be loaded ({type(err).__name__}: {first})"


def load_shard(source: str | os.PathLike[str] | Manifest, shard: int, verify_checksum: bool = True) -> dict[str, Any]:
    """Load one shard's state, on CPU, from a checkpoint.

    Args:
        source: a step directory (its manifest and every shard's size are checked), or the
            :class:`Manifest` that :func:`find_latest` or :func:`resolve_resume` returned.
        shard: the shard index (:func:`shard_of_rank`).
        verify_checksum: check the shard file's size and SHA-256 against the manifest first.

    Returns:
        the state given to :func:`save_shard`, tensors on CPU, numpy arrays as numpy arrays.

    Raises:
        CheckpointError: no manifest, no such shard, a size or checksum mismatch, or a file
            that holds anything but tensors and primitives (``torch.load(weights_only=True)``
            refuses it; nothing in it is executed).
    """
    import torch

    manifest = source if isinstance(source, Manifest) else verify(source, checksums=False)
    path = manifest.shard_path(shard)
    if verify_checksum:
        _check_shard(path, manifest.shards[shard], checksum=True)
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(path, "missing shard file") from None
    except Exception as e:  # UnpicklingError, RuntimeError (bad zip), EOFError...
        raise CheckpointError(path, _load_error(e)) from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT and "state" in payload):
        raise CheckpointError(path, "is not an ftrun checkpoint shard")
    if payload.get("version") != VERSION:
        raise CheckpointError(path, f"shard format version {payload.get('version')!r}, this ftrun reads {VERSION}")
    if payload.get("shard") != shard:
        raise CheckpointError(path, f"holds shard {payload.get('shard')!r}, not shard {shard}")
    return _decode(payload["state"])


# ---------------------------------------------------------------------------------- manifests
def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "unknown")) if torch is not None else "unknown"


def _reported_shards(directory: Path, count: int, shards: Mapping[int, ShardInfo | Mapping[str, Any]],
                     check_files: bool) -> dict[int, ShardInfo]:
    """The writers' reports as ``{k: ShardInfo}``, checked: one per replica group (``count``), all
    of them sliced (holding DCP files) or none, and with ``check_files`` each file there with its
    reported size (stat only).

    Raises:
        ValueError: a shard is missing, an entry is malformed, or sliced and plain shards are mixed.
        CheckpointError: ``check_files`` and a file is missing or has another size.
    """
    infos = {int(k): v if isinstance(v, ShardInfo) else ShardInfo.from_json(v) for k, v in shards.items()}
    if sorted(infos) != list(range(count)):
        raise ValueError(f"checkpoint {directory}: shards {sorted(infos)} reported, expected 0..{count - 1} (one per replica group)")
    if len({bool(info.files) for info in infos.values()}) > 1:
        raise ValueError(f"checkpoint {directory}: some shards hold DCP files and some do not")
    if check_files:
        for info in infos.values():
            for one in (info,) + info.files:
                _check_shard(directory / one.file, one, checksum=False)
    return infos


def write_manifest(
    directory: str | os.PathLike[str],
    step: int,
    world_size: int,
    replica_groups: Sequence[Sequence[int]],
    shards: Mapping[int, ShardInfo | Mapping[str, Any]],
    reason: str = "",
    extra: Mapping[str, Any] | None = None,
    torch_version: str | None = None,
    check_files: bool = True,
) -> Path:
    """Write ``<directory>/manifest.json`` atomically, completing a checkpoint.

    Call it once, from one writer, after every shard's file was reported written. Does not
    import torch.

    Args:
        directory: the step directory (:func:`step_dir`).
        step: the committed step the shards hold.
        world_size: ranks in the job.
        replica_groups: the job's replica groups (stored canonically: :func:`canonical_groups`).
        shards: ``{k: ShardInfo}`` (or its :meth:`ShardInfo.to_json`, as reported by a writer)
            for every ``k`` in ``range(len(replica_groups))``.
        reason: why the checkpoint was taken ("periodic", "ttp", ...).
        extra: free-form JSON to store with it.
        torch_version: the writers' torch version; default: torch's if this process imported
            it, else "unknown".
        check_files: check that every shard file exists with the reported size (stat only).

    Returns:
        the manifest's path.

    Raises:
        ValueError: a shard is missing from ``shards`` or an entry is malformed.
        CheckpointError: ``check_files`` and a shard file is missing or has another size.
        OSError: the manifest cannot be written.
    """
    from ftrun.common import __version__

    directory = Path(directory)
    groups = canonical_groups(replica_groups)
    infos = _reported_shards(directory, len(groups), shards, check_files)
    manifest = Manifest(
        directory=directory,
        step=int(step),
        world_size=int(world_size),
        replica_groups=groups,
        shards=infos,
        ftrun_version=__version__,
        torch_version=torch_version or _torch_version(),
        created=time.time(),
        reason=reason,
        extra=dict(extra or {}),
    )
    final = directory / MANIFEST
    text = json.dumps(manifest.to_json(), indent=1) + "\n"
    write_atomically(final, lambda f: f.write(text.encode("utf-8")))
    return final


ORPHAN_NOTE = "shard_{}.orphan.json"  # beside a shard written after the supervisor died


def write_orphan_note(directory: str | os.PathLike[str], shard: int, info: ShardInfo, world_size: int,
                      replica_groups: Sequence[Sequence[int]], torch_version: str) -> Path:
    """Record, beside a shard a rank wrote after its supervisor died, what the manifest needs
    (:func:`complete_orphaned` turns a full set of them into a manifest). Atomic, like every file here.

    Raises:
        OSError: the note cannot be written.
    """
    final = Path(directory) / ORPHAN_NOTE.format(shard)
    text = json.dumps({"shard": int(shard), "info": info.to_json(), "world_size": int(world_size),
                       "replica_groups": [[int(r) for r in g] for g in replica_groups], "torch_version": torch_version})
    write_atomically(final, lambda f: f.write(text.encode("utf-8")))
    return final


def complete_orphaned(root: str | os.PathLike[str], on_skip: OnSkip | None = None) -> Manifest | None:
    """Complete the dying-gasp checkpoint the ranks wrote on their own after their supervisor died.

    With no supervisor to collect the writers' reports, each writer left an orphan note beside its
    shard (:func:`write_orphan_note`); the launcher, which outlives the supervisor, calls this
    once the ranks are gone. The newest step directory without a manifest whose notes cover every
    shard (and agree on the world and the replica groups) gets its manifest (reason ``"ttp:
    supervisor lost"``) and loses its notes; an incomplete one is left as it is (an incomplete
    checkpoint, which :func:`find_latest` skips). Does not import torch.

    Args:
        root: the checkpoint directory.
        on_skip: called as ``on_skip(path, reason)`` for a directory that cannot be completed.

    Returns:
        the completed checkpoint's :class:`Manifest` (verified), or None.
    """
    report = on_skip or _warn_skip
    for _, directory in _step_dirs(Path(root)):
        notes = sorted(directory.glob(ORPHAN_NOTE.format("*")))
        if (directory / MANIFEST).exists() or not notes:
            continue
        try:
            read = [json.loads(n.read_text()) for n in notes]
            groups = canonical_groups(read[0]["replica_groups"])
            world = int(read[0]["world_size"])
            if any(canonical_groups(r["replica_groups"]) != groups or int(r["world_size"]) != world for r in read):
                raise ValueError("the writers disagree on the world size or the replica groups")
            shards = {int(r["shard"]): ShardInfo.from_json(r["info"]) for r in read}
            write_manifest(directory, _step_of(directory) or 0, world, groups, shards,
                           reason="ttp: supervisor lost", torch_version=str(read[0]["torch_version"]))
            manifest = verify(directory)
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as err:
            report(directory, f"the ranks' checkpoint after the supervisor died is incomplete: {err}")
            continue
        for note in notes:
            note.unlink(missing_ok=True)
        return manifest
    return None


def _check_shard(path: Path, info: ShardInfo, checksum: bool) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(path, "missing shard file") from None
    if size != info.bytes:
        raise CheckpointError(path, f"is {size} bytes, the manifest says {info.bytes} (truncated or overwritten)")
    if checksum:
        size, digest = _sha256_file(path)
        if size != info.bytes:
            raise CheckpointError(path, f"is {size} bytes, the manifest says {info.bytes} (changed while read)")
        if digest != info.sha256:
            raise CheckpointError(path, f"SHA-256 {digest[:12]}... does not match the manifest's {info.sha256[:12]}... (corrupted)")


def _read_manifest(path: Path) -> dict[str, Any]:
    """The JSON object in manifest file ``path``, of a format and a version this ftrun reads.

    Raises:
        CheckpointError: no such file (an incomplete checkpoint) or directory, unreadable, bad
            JSON, not an ftrun manifest, or another version.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problem = "missing manifest (incomplete checkpoint)" if path.parent.is_dir() else "no such checkpoint directory"
        raise CheckpointError(path, problem) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"cannot be read ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"bad JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(path, f"not an ftrun checkpoint manifest (format {data.get('format') if isinstance(data, dict) else None!r})")
    version = data.get("version")
    if version not in (VERSION, SLICED_VERSION):
        raise CheckpointError(path, f"manifest version {version!r}, this ftrun reads {VERSION} and {SLICED_VERSION}")
    return data


def verify(directory: str | os.PathLike[str], checksums: bool = True) -> Manifest:
    """Read a step directory's manifest and check its shard files against it.

    Does not import torch.

    Args:
        directory: the step directory (or its ``manifest.json``).
        checksums: also read every shard file and check its SHA-256 (otherwise sizes only).

    Returns:
        the checkpoint's :class:`Manifest`.

    Raises:
        CheckpointError: missing manifest, bad JSON, wrong format or version, a malformed field,
            a missing shard file, or a size or checksum mismatch (naming the file).
    """
    directory = Path(directory)
    if directory.name == MANIFEST and directory.is_file():
        directory = directory.parent
    path = directory / MANIFEST
    data = _read_manifest(path)
    try:
        manifest = Manifest.from_json(data, directory)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(path, f"malformed manifest ({type(e).__name__}: {e})") from None
    unusable = read_unusable_note(directory)
    if unusable is not None:
        raise CheckpointError(*unusable)
    for k in sorted(manifest.shards):
        for one in (manifest.shards[k],) + manifest.shards[k].files:
            _check_shard(directory / one.file, one, checksum=checksums)
    return manifest


def mark_unusable(directory: str | os.PathLike[str], err: CheckpointError) -> None:
    """Record in a step directory that one of its shards does not load (``err`` names the file and
    the problem: a payload ``weights_only`` refuses, a bad archive...). Every later :func:`verify`
    of it fails with that error, so the supervisor skips it for the next older checkpoint, as it
    skips a checksum mismatch, and a later ``--resume auto`` does too. Written atomically; a
    failure to write is ignored (the rank's own error still says what happened)."""
    note = Path(directory) / UNUSABLE_NOTE
    text = json.dumps({"file": str(err.path), "problem": err.problem})
    try:
        write_atomically(note, lambda f: f.write(text.encode("utf-8")))
    except OSError:
        pass


def read_unusable_note(directory: Path) -> tuple[Path, str] | None:
    """(the file at fault, the problem) that :func:`mark_unusable` recorded in ``directory``, or None."""
    try:
        data = json.loads((directory / UNUSABLE_NOTE).read_text(encoding="utf-8"))
        return Path(str(data["file"])), f"does not load: {str(data['problem'])[:500]} (found by a rank at resume)"
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return directory / UNUSABLE_NOTE, "marked unusable by a rank at resume"


# ------------------------------------------------------------------------------------- resume
OnSkip = Callable[[Path, str], None]


def _warn_skip(path: Path, reason: str) -> None:
    warnings.warn(f"skipping checkpoint: {path}: {reason}", RuntimeWarning, stacklevel=3)


def find_latest(root: str | os.PathLike[str], on_skip: OnSkip | None = None, checksums: bool = True) -> Manifest | None:
    """The newest checkpoint under ``root`` that verifies (:func:`verify`).

    Step directories are tried newest first. One that does not verify (no manifest: an
    incomplete checkpoint; bad JSON; a missing, truncated or corrupted shard file) is reported
    through ``on_skip`` and the next older one is tried. Entries that are not ``step_<n>``
    directories (temporary files, anything else) are ignored.

    Args:
        root: the checkpoint directory (``--checkpoint_dir``); missing is the same as empty.
        on_skip: called as ``on_skip(path, reason)`` for each skipped checkpoint, ``path``
            naming the file at fault; default: a ``RuntimeWarning``.
        checksums: check SHA-256s (reads every shard file), not only sizes.

    Returns:
        the newest good checkpoint's :class:`Manifest`, or None when there is none.
    """
    report = on_skip or _warn_skip
    for _, directory in _step_dirs(Path(root)):
        try:
            return verify(directory, checksums=checksums)
        except CheckpointError as e:
            report(e.path, e.problem)
    return None


def resolve_resume(root: str | os.PathLike[str] | None, resume: str, on_skip: OnSkip | None = None) -> Manifest | None:
    """The checkpoint ``--resume`` names.

    Args:
        root: the checkpoint directory searched by ``"auto"`` (None: no checkpoint directory).
        resume: ``"none"`` (start fresh), ``"auto"`` (the newest good checkpoint under ``root``,
            if any: bad ones are skipped through ``on_skip``), or a PATH: a step directory (or
            its ``manifest.json``), which must verify; or a directory of ``step_<n>``
            checkpoints, searched like ``"auto"``, which must hold at least one good checkpoint.
        on_skip: as in :func:`find_latest`.

    Returns:
        the :class:`Manifest` to resume from, or None to start fresh.

    Raises:
        CheckpointError: an explicit PATH that does not exist, does not verify, or holds no
            good checkpoint.
    """
    choice = resume.strip()
    if choice.lower() in ("none", ""):
        return None
    if choice.lower() == "auto":
        if root is None:
            return None
        complete_orphaned(root, on_skip=lambda *_: None)  # a full set the supervisor could not record (it died)
        return find_latest(root, on_skip)
    path = Path(choice).expanduser()
    if not path.exists():
        raise CheckpointError(path, "no such checkpoint")
    if path.is_file() and path.name != MANIFEST:
        raise CheckpointError(path, f"is a file; give a step directory (or its {MANIFEST}) or a directory of them")
    if path.is_file() or (path / MANIFEST).exists() or _step_of(path) is not None:
        return verify(path)
    if not _step_dirs(path):
        raise CheckpointError(path, f"is neither a checkpoint (no {MANIFEST}) nor a directory of step_<n> checkpoints")
    complete_orphaned(path, on_skip=lambda *_: None)
    skipped: list[str] = []

    def note(p: Path, reason: str) -> None:
        skipped.append(f"{p}: {reason}")
        (on_skip or _warn_skip)(p, reason)

    manifest = find_latest(path, note)
    if manifest is None:
        raise CheckpointError(path, f"holds no usable checkpoint ({len(skipped)} skipped; newest: {skipped[0]})")
    return manifest


def prune(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``.

    *Complete* means the manifest reads and every shard file has its size (checksums are not
    read). Incomplete step directories older than the newest complete checkpoint are stale (their
    writer died) and are deleted too; newer ones may still be being written and are kept. The
    newest complete checkpoint is never deleted. Safe against a concurrent prune (files already
    gone are ignored). Does not import torch.

    Args:
        root: the checkpoint directory.
        keep: how many complete checkpoints to keep (``--keep_checkpoints``), at least 1.

    Returns:
        the step directories deleted, oldest first.

    Raises:
        ValueError: ``keep`` < 1.
    """
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be at least 1, got {keep}")
    complete: list[tuple[int, Path]] = []
    incomplete: list[tuple[int, Path]] = []
    for step, directory in _step_dirs(Path(root)):
        try:
            verify(directory, checksums=False)
            complete.append((step, directory))
        except CheckpointError:
            incomplete.append((step, directory))
    if not complete:
        return []
    newest = complete[0][0]
    doomed = complete[keep:] + [(s, d) for s, d in incomplete if s < newest]
    removed = []
    for _, directory in sorted(doomed):
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            removed.append(directory)
    return removed


# ----------------------------------------------------------------------- periodic (async) saves
def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of ``state`` that training may go on changing the original of.

    Tensors are detached and copied to CPU (a tensor that appears twice is copied once, so
    sharing is kept); numpy arrays are copied; dicts (OrderedDict and ``_metadata`` kept),
    lists and tuples are rebuilt; primitives are shared. This is the part of a periodic
    checkpoint that blocks training: about a memcpy of the state. A CUDA tensor is copied into
    pinned host memory without a wait of its own (reused from save to save), and the snapshot
    waits once for all of them at its end (a copy to pageable memory waits tensor by tensor).

    Args:
        state: nested containers of tensors, numpy arrays and primitives.
        reuse: an earlier snapshot no longer in use: a tensor or array at the same place with the
            same dtype and shape is overwritten instead of allocating a new one (much faster
            for large states: no fresh pages to fault in).

    Returns:
        the copy.

    Raises:
        TypeError: the state holds an object that cannot be checkpointed (naming its place), so
            the error shows at the save, not later in the writer thread.
    """
    import torch

    copier = _StateCopier()
    out = copier.copy(state, reuse, "state")
    if copier.from_cuda:
        torch.cuda.synchronize()  # the copies into pinned memory ran without waiting
    return out


class _StateCopier:
    """One :func:`snapshot` under way: the copy of each tensor made so far (a tensor that appears
    twice is copied once), the buffers of the earlier snapshot already taken (each is reused once),
    and whether a CUDA tensor was copied (the snapshot then waits for the copies once, at its end).

    A place in the state (``path``) is a string, or ``(parent, key)`` for a plain dict's child,
    written out (:meth:`where`) only where it is used: in a message, or below a container other
    than a dict.
    """

    def __init__(self) -> None:
        import numpy as np
        import torch

        self._np = np
        self._torch = torch
        self._copies: dict[int, Any] = {}
        self._used: set[int] = set()
        self.from_cuda = False

    @staticmethod
    def where(path: Any) -> str:
        """A place in the state, written out."""
        return path if type(path) is str else _key_path(_StateCopier.where(path[0]), path[1])

    def reusable(self, old: Any, like: Any) -> bool:
        """Whether ``old`` (of the earlier snapshot) can take ``like``'s copy: not taken yet, same dtype and shape."""
        return id(old) not in self._used and old.dtype == like.dtype and old.shape == like.shape

    def copy(self, obj: Any, old: Any, path: Any) -> Any:
        """The copy of ``obj``, into ``old`` (the earlier snapshot's value at the same place) where it fits.

        Raises:
            TypeError: ``obj`` holds an object that cannot be checkpointed (naming its place).
        """
        kind = type(obj)
        if kind in _SCALARS:  # shared, as the last line would (and with no isinstance walk: a step start copies small dicts)
            return obj
        if kind is dict:
            prior = old if isinstance(old, dict) else {}
            return {k if type(k) is str else _check_key(k, self.where(path)): self.copy(v, prior.get(k), (path, k))
                    for k, v in obj.items()}
        path = self.where(path)
        if isinstance(obj, self._torch.Tensor):
            return self.copy_tensor(obj, old, path)
        if isinstance(obj, self._np.ndarray):
            return self.copy_array(obj, old, path)
        if isinstance(obj, Mapping):
            out = _new_dict(obj)
            prior = old if isinstance(old, Mapping) else {}
            for k, v in obj.items():
                out[_check_key(k, path)] = self.copy(v, prior.get(k), _key_path(path, k))
            return out
        if isinstance(obj, (list, tuple)) and not isinstance(obj, self._torch.Size):
            return self.copy_sequence(obj, old, path)
        return _encode(obj, path)  # primitives, dtypes, devices, sizes; raises on anything else

    def copy_tensor(self, obj: Any, old: Any, path: str) -> Any:
        """A tensor detached and copied to CPU: into ``old`` when it is a contiguous CPU tensor that
        fits, else into a new buffer (pinned for a CUDA tensor); sparse and quantized tensors by
        torch's own copy."""
        torch = self._torch
        if id(obj) in self._copies:
            return self._copies[id(obj)]
        src = _encode(obj, path).detach()
        if (
            type(old) is torch.Tensor
            and old.device.type == "cpu"
            and old.layout == torch.strided == src.layout
            and old.is_contiguous()
            and self.reusable(old, src)
        ):
            _copy_into(old, src)
            out = old
        elif src.layout == torch.strided and not src.is_quantized:
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            _copy_into(out, src)
        else:  # sparse, quantized: torch's own copy
            out = src.to("cpu", copy=True)
        self._used.add(id(out))
        self._copies[id(obj)] = out
        if src.is_cuda:
            self.from_cuda = True
        return out

    def copy_array(self, obj: Any, old: Any, path: str) -> Any:
        """A numpy array copied: into ``old`` when it is a writeable array that fits."""
        _encode(obj, path)  # type check
        if isinstance(old, self._np.ndarray) and old.flags.writeable and self.reusable(old, obj):
            self._np.copyto(old, obj)
            out = old
        else:
            out = obj.copy()
        self._used.add(id(out))
        return out

    def copy_sequence(self, obj: list[Any] | tuple[Any, ...], old: Any, path: str) -> list[Any] | tuple[Any, ...]:
        """A list or plain tuple rebuilt (a tuple of primitives is shared); a named tuple or another
        tuple subclass raises TypeError."""
        if type(obj) in (list, tuple) and all(type(v) in _SCALARS for v in obj):
            return list(obj) if type(obj) is list else obj  # a long list of numbers: one pass
        if isinstance(obj, tuple) and type(obj) is not tuple:
            _encode(obj, path)  # raises: named tuples and other tuple subclasses
        prior = old if isinstance(old, (list, tuple)) and len(old) == len(obj) else [None] * len(obj)
        items = [self.copy(v, prior[i], f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)


def _copy_into(dst: Any, src: Any) -> None:
    """``dst.copy_(src)``; a plain ``memmove`` (one thread, GIL released) for contiguous CPU tensors.

    torch's own copy splits large copies over its intra-op threads, which was 3 to 4 times slower
    than one ``memmove`` on a busy 2-core machine (the threads wait on each other).
    """
    nbytes = src.numel() * src.element_size()
    plain = not (src.is_conj() or src.is_neg())
    if plain and src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape:
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.copy_(src, non_blocking=src.is_cuda and dst.is_pinned())  # waited for at the snapshot's end


class AsyncCheckpointer:
    """Periodic checkpoints written from a background thread while training goes on.

    :meth:`save` blocks training only for :func:`snapshot` (a copy of the state into buffers
    reused from the previous save), then one daemon thread writes the shard (:func:`save_shard`),
    the manifest when this process is the only writer, and prunes old checkpoints.

    One write at a time: if the previous write is still running, :meth:`save` first waits for it.
    This bounds memory at one snapshot (which is reused) and makes the cost of saving too often
    visible as blocked time rather than a growing queue; save no more often than a write takes.

    Args:
        root: the checkpoint directory; step ``s`` goes to :func:`step_dir` ``(root, s)``.
        shard: the shard this process writes (:func:`shard_of_rank`).
        keep: after each write, keep only the newest ``keep`` complete checkpoints
            (:func:`prune`); None keeps all. In a job with several shards, prefer pruning where
            the manifest is written (a shard writer can only prune checkpoints already complete).
        single_writer: this process writes the only shard (one replica group: one process, or
            pure data parallel with rank 0 writing) and writes the manifest itself.
        world_size, replica_groups: recorded in the manifest when ``single_writer``; default one
            group of ``world_size`` ranks.
        reason: the manifest's ``reason``.

    Raises:
        ValueError: ``single_writer`` with more than one replica group, or ``keep`` < 1.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        shard: int = 0,
        keep: int | None = None,
        *,
        single_writer: bool = False,
        world_size: int = 1,
        replica_groups: Sequence[Sequence[int]] | None = None,
        reason: str = "periodic",
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep}")
        self.root = Path(root)
        self.shard = int(shard)
        self.keep = keep
        self.single_writer = single_writer
        self.world_size = int(world_size)
        self.replica_groups = canonical_groups(replica_groups or [list(range(self.world_size))])
        if single_writer and len(self.replica_groups) != 1:
            raise ValueError(f"single_writer needs one replica group, got {len(self.replica_groups)}: the manifest must wait for every shard")
        self.reason = reason
        self.last_blocked_s = 0.0  # seconds the last save() held training (wait + snapshot)
        self.last_snapshot_s = 0.0  # seconds of the last snapshot copy
        self.last_write_s = 0.0  # seconds the last background write took
        self._cv = threading.Condition()
        self._job: tuple[int, Any, Callable[[int, Any], None] | None, Any] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._buffers: Any = None
        self._thread = threading.Thread(target=self._run, name=f"ftrun-checkpoint-{self.shard}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def save(self, step: int, state: Any, on_done: Callable[[int, Any], None] | None = None,
             slices: Callable[[], Callable[[Path], Sequence[ShardInfo]]] | None = None) -> float:
        """Snapshot ``state`` now and write it as step ``step`` in the background.

        Call at a step boundary (after the optimizer update of ``step``). Errors of an earlier
        write are not raised here: they went to its ``on_done`` and :meth:`wait` raises them.

        Args:
            step: the committed step the state is at.
            state: what to save (e.g. ``Worker.state_dict()``); may be changed as soon as this
                returns.
            on_done: called from the writer thread as ``on_done(step, result)``, ``result`` being
                the :class:`ShardInfo` written or the exception that stopped the write.
            slices: a sliced checkpoint's sharded part (:mod:`ftrun.rank.dcp`): called at the snapshot
                (after the wait for the previous write), it copies the sharded state and returns
                what writes that copy into a step directory in the writer thread (returning the
                files' records, which the result's :attr:`ShardInfo.files` then holds).

        Returns:
            the seconds training was blocked (waiting for the previous write, plus the snapshot).

        Raises:
            TypeError: the state holds something that cannot be checkpointed.
            RuntimeError: the checkpointer is closed.
        """
        start = time.perf_counter()
        with self._cv:
            if self._closed:
                raise RuntimeError("AsyncCheckpointer.save() after close()")
            while self._busy:
                self._cv.wait()
        copied = time.perf_counter()
        snap = snapshot(state, reuse=self._buffers)
        self._buffers = snap
        write_slices = slices() if slices is not None else None
        now = time.perf_counter()
        self.last_snapshot_s = now - copied
        self.last_blocked_s = now - start
        with self._cv:
            self._job = (int(step), snap, on_done, write_slices)
            self._busy = True
            self._cv.notify_all()
        return self.last_blocked_s

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closed:
                    self._cv.wait()
                if self._job is None:
                    return
                step, snap, on_done, write_slices = self._job
                self._job = None
            start = time.perf_counter()
            result: Any
            try:
                result = self._write(step, snap, write_slices)
            except BaseException as e:  # delivered to on_done and raised by wait()
                result = e
                self._error = e
            self.last_write_s = time.perf_counter() - start
            if on_done is not None:
                try:
                    on_done(step, result)
                except BaseException as e:
                    self._error = e
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _write(self, step: int, snap: Any, write_slices: Callable[[Path], Sequence[ShardInfo]] | None = None) -> ShardInfo:
        directory = step_dir(self.root, step)
        info = save_shard(directory, self.shard, snap)
        if write_slices is not None:
            info = ShardInfo(info.file, info.bytes, info.sha256, tuple(write_slices(directory)))
        if self.single_writer:
            write_manifest(directory, step, self.world_size, self.replica_groups, {self.shard: info}, reason=self.reason)
        if self.keep is not None:
            prune(self.root, self.keep)
        return info

    @property
    def busy(self) -> bool:
        """Whether a write is in progress."""
        with self._cv:
            return self._busy

    def wait(self) -> None:
        """Wait until the pending write (if any) is done.

        Raises:
            BaseException: the error of the latest failed write (or ``on_done`` call) since the
                last :meth:`wait`, as raised in the writer thread (e.g. ``OSError``).
        """
        with self._cv:
            while self._busy:
                self._cv.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the pending write, stop the thread. Idempotent; does not raise write errors."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self.close)

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

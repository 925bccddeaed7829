"""Unit tests of ftrun.common.checkpoint: format, atomic writes, verification, resume, pruning, async saves.

All in one process, on small states; corruption is made by editing files, never by timing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftrun.common import checkpoint as ckpt
from ftrun.common.checkpoint import AsyncCheckpointer, CheckpointError, ShardInfo
from ftrun.rank.transfer import RNGState


def _realistic_state() -> dict[str, Any]:
    """Model, SGD-with-momentum, AdamW, LR scheduler and RNG states after a training step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(list(model[2].parameters()) + list(model[3].parameters()), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    loss = model(torch.randn(16, 4)).square().mean()
    loss.backward()
    sgd.step()
    adamw.step()
    sched.step()
    random.random()
    np.random.rand(3)
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    return {
        "model": model.state_dict(),
        "sgd": sgd.state_dict(),
        "adamw": adamw.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": RNGState().state_dict(),
        "data": {"position": 17, "epoch": 2, "name": "digits", "none": None, "nested": [[1, 2.5], ["a", None, True]]},
        "tuple": (1, (2, "x")),
        "array": np.arange(12, dtype=np.int64).reshape(3, 4),
        "scalar": np.float32(0.25),
    }


def _assert_same(a: Any, b: Any, path: str = "state") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _complete(root: Path, step: int, state: dict[str, Any] | None = None) -> Path:
    """A complete one-shard checkpoint of ``step``."""
    directory = ckpt.step_dir(root, step)
    info = ckpt.save_shard(directory, 0, state if state is not None else {"step": step, "w": torch.full((64,), float(step))})
    ckpt.write_manifest(directory, step, 1, [[0]], {0: info}, reason="test")
    return directory


def test_round_trip_of_a_realistic_state(tmp_path: Path) -> None:
    state = _realistic_state()
    directory = ckpt.step_dir(tmp_path, 7)
    info = ckpt.save_shard(directory, 0, state)
    assert info.file == "shard_0.pt" and info.bytes == (directory / "shard_0.pt").stat().st_size
    ckpt.write_manifest(directory, 7, 1, [[0]], {0: info.to_json()})
    loaded = ckpt.load_shard(directory, 0)

    expected = dict(state, scalar=0.25)  # numpy scalars come back as Python scalars
    _assert_same(expected, loaded)
    assert not [p for p in directory.iterdir() if p.name.startswith(".")], "temporary files left behind"

    # The loaded state restores real objects and the RNG streams continue identically.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model.load_state_dict(loaded["model"])
    adamw = torch.optim.AdamW(list(model[2].parameters()) + list(model[3].parameters()), lr=1e-3)
    adamw.load_state_dict(loaded["adamw"])
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    sgd.load_state_dict(loaded["sgd"])
    torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5).load_state_dict(loaded["scheduler"])
    RNGState().load_state_dict(state["rng"])
    draws = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random())
    RNGState().load_state_dict(loaded["rng"])
    again = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2:] == again[2:]


def test_manifest_records_the_job(tmp_path: Path) -> None:
    directory = ckpt.step_dir(tmp_path, 12)
    infos = {k: ckpt.save_shard(directory, k, {"k": k, "t": torch.ones(k + 1)}) for k in (0, 1)}
    path = ckpt.write_manifest(directory, 12, 4, [[3, 1], [2, 0]], {k: v.to_json() for k, v in infos.items()}, reason="ttp", extra={"note": 1}, torch_version="9.9")
    data = json.loads(path.read_text())
    assert data["format"] == "ftrun-checkpoint" and data["version"] == 1 and data["step"] == 12 and data["world_size"] == 4
    assert data["replica_groups"] == [[0, 2], [1, 3]]  # canonical: shard k is the k-th group by smallest rank
    assert data["shards"]["1"] == infos[1].to_json() and data["torch_version"] == "9.9" and data["reason"] == "ttp"
    assert ckpt.shard_of_rank(3, [[3, 1], [2, 0]]) == 1
    manifest = ckpt.verify(directory)
    assert manifest.step == 12 and manifest.shards == infos and manifest.extra == {"note": 1}
    assert ckpt.load_shard(manifest, 1)["k"] == 1
    with pytest.raises(ValueError, match="expected 0..1"):
        ckpt.write_manifest(directory, 12, 4, [[0, 2], [1, 3]], {0: infos[0]})


def test_verify_names_what_is_wrong_with_a_manifest(tmp_path: Path) -> None:
    directory = ckpt.step_dir(tmp_path, 3)
    path = ckpt.write_manifest(directory, 3, 1, [[0]], {0: ckpt.save_shard(directory, 0, {"k": 3})})
    good = json.loads(path.read_text())
    manifest = ckpt.verify(path)  # the manifest file itself names its directory too
    assert ckpt.Manifest.from_json(manifest.to_json(), directory) == manifest
    cases = [("{", "bad JSON"), (json.dumps({**good, "format": "other"}), "not an ftrun checkpoint manifest"),
             (json.dumps({**good, "version": 7}), "manifest version 7, this ftrun reads 1 and 2"),
             (json.dumps({**good, "step": -1}), r"malformed manifest \(ValueError: step -1"),
             (json.dumps({k: v for k, v in good.items() if k != "shards"}), r"malformed manifest \(KeyError"),
             (json.dumps({**good, "replica_groups": [[0], [1]]}), "do not match 2 replica groups")]
    for text, problem in cases:
        path.write_text(text)
        with pytest.raises(CheckpointError, match=problem):
            ckpt.verify(directory)
    path.unlink()
    with pytest.raises(CheckpointError, match="missing manifest"):
        ckpt.verify(directory)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        ckpt.verify(tmp_path / "nowhere")


def test_orphaned_writers_notes_complete_a_checkpoint(tmp_path: Path) -> None:
    # Ranks whose supervisor died write their shards with notes; the launcher completes the newest
    # full set, leaves an incomplete one alone.
    groups = [[0, 2], [1, 3]]
    partial = ckpt.step_dir(tmp_path, 15)
    info = ckpt.save_shard(partial, 0, {"t": torch.ones(2)})
    ckpt.write_orphan_note(partial, 0, info, 4, groups, "9.9")
    skipped: list[str] = []
    assert ckpt.complete_orphaned(tmp_path, on_skip=lambda path, why: skipped.append(why)) is None
    assert "expected 0..1" in skipped[0] and not (partial / ckpt.MANIFEST).exists()
    full = ckpt.step_dir(tmp_path, 14)
    for k in (0, 1):
        ckpt.write_orphan_note(full, k, ckpt.save_shard(full, k, {"k": k}), 4, [[2, 0], [3, 1]], "9.9")
    manifest = ckpt.complete_orphaned(tmp_path, on_skip=lambda path, why: None)
    assert manifest is not None and manifest.step == 14 and manifest.replica_groups == groups
    assert manifest.reason == "ttp: supervisor lost" and manifest.torch_version == "9.9"
    assert ckpt.load_shard(manifest, 1)["k"] == 1 and not list(full.glob("*.orphan.json"))
    assert ckpt.find_latest(tmp_path, on_skip=lambda path, why: None).step == 14  # step 15 stays incomplete
    assert ckpt.complete_orphaned(tmp_path, on_skip=lambda path, why: None) is None  # nothing left to complete


@pytest.mark.parametrize("resume", ["auto", "root"])
def test_the_next_start_completes_a_full_set_the_supervisor_could_not_record(tmp_path: Path, resume: str) -> None:
    """The supervisor died (a full log disk) after the ranks wrote every shard of step 65 with their
    notes: ``--resume auto`` (or the checkpoint directory as PATH) completes and uses it, not step 0."""
    older = ckpt.step_dir(tmp_path, 60)
    ckpt.write_manifest(older, 60, 2, [[0, 1]], {0: ckpt.save_shard(older, 0, {"k": 60})})
    newest = ckpt.step_dir(tmp_path, 65)
    ckpt.write_orphan_note(newest, 0, ckpt.save_shard(newest, 0, {"k": 65}), 2, [[0, 1]], "9.9")
    skipped: list[str] = []
    manifest = ckpt.resolve_resume(tmp_path, "auto" if resume == "auto" else str(tmp_path),
                                   on_skip=lambda path, why: skipped.append(why))
    assert manifest is not None and manifest.step == 65 and not skipped
    assert ckpt.load_shard(manifest, 0)["k"] == 65


def test_write_manifest_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, json; from pathlib import Path; from ftrun.common import checkpoint as c\n"
        "d = Path(sys.argv[1]); d.mkdir(); (d / 'shard_0.pt').write_bytes(b'x')\n"
        "c.write_manifest(d, 1, 1, [[0]], {0: {'file': 'shard_0.pt', 'bytes': 1, 'sha256': '0' * 64}})\n"
        "c.find_latest(d.parent, on_skip=lambda p, r: None); c.prune(d.parent, 1)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
        "print(json.loads((d / 'manifest.json').read_text())['torch_version'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "step_000000001")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "unknown"


def test_save_refuses_objects_that_are_not_tensors_or_primitives(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['opt'\]\['hook'\]"):
        ckpt.save_shard(tmp_path / "s", 0, {"opt": {"lr": 0.1, "hook": object()}})
    with pytest.raises(TypeError, match="object"):
        ckpt.save_shard(tmp_path / "s", 0, {"a": np.array([object()])})
    assert not (tmp_path / "s" / "shard_0.pt").exists()


class Payload:
    """An arbitrary pickled object: unpickling it would create a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.marker),))


def test_load_refuses_arbitrary_pickles_without_executing_them(tmp_path: Path) -> None:
    directory = _complete(tmp_path, 1)
    marker = tmp_path / "executed"
    shard = directory / "shard_0.pt"
    torch.save({"format": "ftrun-checkpoint", "version": 1, "shard": 0, "state": {"x": Payload(str(marker))}}, shard)
    ckpt.write_manifest(directory, 1, 1, [[0]], {0: ckpt.file_info(directory, "shard_0.pt")})
    ckpt.verify(directory)  # sizes and checksums are right: the content is what is refused
    with pytest.raises(CheckpointError, match="shard_0.pt.*not plain tensors"):
        ckpt.load_shard(directory, 0)
    assert not marker.exists()


def test_truncated_shard_is_skipped_for_an_older_checkpoint(tmp_path: Path) -> None:
    _complete(tmp_path, 1)
    bad = _complete(tmp_path, 2) / "shard_0.pt"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    skipped: list[tuple[Path, str]] = []
    manifest = ckpt.find_latest(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert manifest is not None and manifest.step == 1
    assert skipped == [(bad, skipped[0][1])] and "truncated" in skipped[0][1]
    assert ckpt.load_shard(manifest, 0)["step"] == 1


def test_missing_manifest_is_skipped_and_temporary_entries_ignored(tmp_path: Path) -> None:
    _complete(tmp_path, 5)
    ckpt.save_shard(ckpt.step_dir(tmp_path, 6), 0, {"x": 1})  # a shard, but the job died before the manifest
    (tmp_path / ".step_000000009.tmp").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    skipped: list[tuple[Path, str]] = []
    manifest = ckpt.find_latest(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert manifest is not None and manifest.step == 5
    assert [(p.name, p.parent.name) for p, _ in skipped] == [("manifest.json", "step_000000006")]
    assert "missing manifest" in skipped[0][1]
    with pytest.warns(RuntimeWarning, match="step_000000006.*missing manifest"):
        ckpt.find_latest(tmp_path)
    assert ckpt.find_latest(tmp_path / "nowhere") is None


def test_checksum_mismatch_is_skipped(tmp_path: Path) -> None:
    _complete(tmp_path, 3)
    bad = _complete(tmp_path, 4) / "shard_0.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    bad.write_bytes(bytes(data))
    skipped: list[tuple[Path, str]] = []
    manifest = ckpt.find_latest(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert manifest is not None and manifest.step == 3
    assert skipped[0][0] == bad and "SHA-256" in skipped[0][1]
    with pytest.raises(CheckpointError, match="corrupted"):
        ckpt.load_shard(bad.parent, 0)


def test_verify_names_the_file_and_the_problem(tmp_path: Path) -> None:
    directory = _complete(tmp_path, 1)
    manifest = directory / "manifest.json"
    good = manifest.read_text()
    manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: bad JSON"):
        ckpt.verify(directory)
    manifest.write_text(good.replace('"version": 1', '"version": 99'))
    with pytest.raises(CheckpointError, match="version 99"):
        ckpt.verify(directory)
    manifest.write_text(good)
    (directory / "shard_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"shard_0.pt: missing shard file") as err:
        ckpt.verify(directory)
    assert "\n" not in str(err.value)


def test_resolve_resume(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert ckpt.resolve_resume(root, "auto") is None
    good = _complete(root, 1)
    bad = _complete(root, 2)
    (bad / "manifest.json").unlink()
    quiet = lambda p, r: None  # noqa: E731
    assert ckpt.resolve_resume(root, "none") is None
    assert ckpt.resolve_resume(root, "auto", on_skip=quiet).step == 1
    assert ckpt.resolve_resume(None, str(good)).step == 1
    assert ckpt.resolve_resume(None, str(good / "manifest.json")).step == 1
    assert ckpt.resolve_resume(None, str(root), on_skip=quiet).step == 1  # a root: newest good one
    with pytest.raises(CheckpointError, match="step_000000002.*missing manifest"):
        ckpt.resolve_resume(root, str(bad))  # an explicit PATH must verify
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ckpt.resolve_resume(root, str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="is a file"):
        ckpt.resolve_resume(root, str(good / "shard_0.pt"))
    (good / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.resolve_resume(None, str(root), on_skip=quiet)


def test_prune_keeps_the_newest_complete(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        _complete(tmp_path, step)
    stale = ckpt.step_dir(tmp_path, 3)
    (stale / "manifest.json").unlink()  # incomplete, older than the newest complete: stale
    ckpt.save_shard(ckpt.step_dir(tmp_path, 6), 0, {"x": 1})  # newer, maybe still being written: kept
    removed = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_000000001", "step_000000002", "step_000000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005", "step_000000006"]
    assert ckpt.prune(tmp_path, keep=2) == []
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, keep=0)


def test_snapshot_copies_and_reuses_buffers() -> None:
    weight = torch.nn.Parameter(torch.arange(4.0))
    live = OrderedDict(w=weight, tied=weight, arr=np.ones(3), meta=(1, "a"))
    live._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    snap = ckpt.snapshot(live)
    assert type(snap["w"]) is torch.Tensor and snap["w"] is snap["tied"] and snap._metadata == {"": {"version": 1}}
    with torch.no_grad():
        weight.add_(10)
    live["arr"][:] = 7
    assert torch.equal(snap["w"], torch.arange(4.0)) and np.array_equal(snap["arr"], np.ones(3))
    again = ckpt.snapshot(live, reuse=snap)
    assert again["w"] is snap["w"] and again["arr"] is snap["arr"] and torch.equal(again["w"], weight.detach())
    with pytest.raises(TypeError, match=r"state\['bad'\]"):
        ckpt.snapshot({"bad": threading.Lock()})


def test_async_checkpointer_writes_a_snapshot(tmp_path: Path) -> None:
    live = {"w": torch.zeros(1000), "step": 0}
    done: list[tuple[int, Any]] = []
    gate = threading.Event()

    def on_done(step: int, result: Any) -> None:
        gate.wait(10)  # hold the writer thread until the live state has changed
        done.append((step, result))

    with AsyncCheckpointer(tmp_path, shard=0, keep=2, single_writer=True) as saver:
        for step in (1, 2, 3):
            live["w"].fill_(step)
            live["step"] = step
            saver.save(step, live, on_done=on_done)
            live["w"].fill_(-1)  # in place, after the snapshot: must not reach the file
            live["step"] = -1
            gate.set()
            saver.wait()
            gate.clear()
    assert [s for s, _ in done] == [1, 2, 3] and all(isinstance(r, ShardInfo) for _, r in done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002", "step_000000003"]  # keep=2
    manifest = ckpt.find_latest(tmp_path)
    assert manifest is not None and manifest.step == 3 and manifest.reason == "periodic"
    state = ckpt.load_shard(manifest, 0)
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((1000,), 3.0))
    assert manifest.shards[0] == done[-1][1]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_async_checkpointer_surfaces_an_unwritable_root(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    results: list[Any] = []
    try:
        saver = AsyncCheckpointer(root, shard=0)
        saver.save(1, {"w": torch.ones(3)}, on_done=lambda step, result: results.append(result))
        with pytest.raises(PermissionError):
            saver.wait()
        saver.wait()  # the error is raised once
        saver.close()
    finally:
        root.chmod(0o700)
    assert len(results) == 1 and isinstance(results[0], PermissionError)


def test_async_checkpointer_surfaces_a_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    results: list[Any] = []
    with AsyncCheckpointer(blocker / "ckpt", shard=0) as saver:
        saver.save(1, {"w": torch.ones(3)}, on_done=lambda step, result: results.append(result))
        with pytest.raises(OSError):
            saver.wait()
    assert len(results) == 1 and isinstance(results[0], OSError)
    with pytest.raises(RuntimeError, match="after close"):
        saver.save(2, {})


def test_single_writer_needs_one_replica_group(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one replica group"):
        AsyncCheckpointer(tmp_path, single_writer=True, world_size=2, replica_groups=[[0], [1]])


def test_a_shard_that_does_not_load_marks_its_checkpoint_unusable(tmp_path: Path) -> None:
    """A shard under a valid manifest (size and checksum match) that torch.load(weights_only=True)
    refuses: the rank that tried it marks the checkpoint, and every later search skips it for the
    next older one, naming the file (round 3: it was chosen again at every restart)."""
    import hashlib
    import pathlib

    from ftrun.rank.shards import RankCheckpoints

    _complete(tmp_path, 3)
    directory = _complete(tmp_path, 4)
    shard = directory / "shard_0.pt"
    torch.save({"format": "ftrun-checkpoint", "version": 1, "shard": 0, "state": {"x": pathlib.PurePosixPath("/")}}, shard)
    data = shard.read_bytes()
    ckpt.write_manifest(directory, 4, 1, [[0]], {0: ShardInfo("shard_0.pt", len(data), hashlib.sha256(data).hexdigest())})
    assert ckpt.find_latest(tmp_path).step == 4  # nothing but loading it can tell
    rank = RankCheckpoints(None, [[0]], send=lambda *a, **k: None)
    rank.bind(0)
    with pytest.raises(CheckpointError, match="not plain tensors"):
        rank.resume(directory)
    skipped: list[tuple[Path, str]] = []
    manifest = ckpt.find_latest(tmp_path, on_skip=lambda p, r: skipped.append((p, r)))
    assert manifest is not None and manifest.step == 3
    assert skipped == [(shard, skipped[0][1])] and "does not load" in skipped[0][1]
    with pytest.raises(CheckpointError, match="does not load"):
        ckpt.verify(directory)


def test_snapshot_of_plain_dicts_rebuilds_them_and_shares_primitives() -> None:
    """Plain dicts and primitives take a short path (a step start copies small replica
    dicts); the copy is what the general path gives: new dicts, numpy keys as Python scalars."""
    import numpy as np

    from ftrun.common.checkpoint import snapshot

    inner = {"lr": 20.0, "name": "x", "on": True, "none": None, np.int64(3): b"b"}
    state = {"annealing": inner, "t": torch.ones(2)}
    copy = snapshot(state)
    assert copy == {"annealing": {"lr": 20.0, "name": "x", "on": True, "none": None, 3: b"b"}, "t": copy["t"]}
    assert copy["annealing"] is not inner and type(next(reversed(copy["annealing"]))) is int
    assert copy["t"] is not state["t"] and torch.equal(copy["t"], state["t"])
    with pytest.raises(TypeError, match=r"state\['annealing'\]\['bad'\]"):
        snapshot({"annealing": {"bad": object()}})

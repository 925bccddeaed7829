"""Sliced checkpoints of sharded models (torch.distributed.checkpoint's format, ftrun.rank.dcp): the
writers' metadata merged and checked without processes; a checkpoint written by 4 ranks on a 2x2
HSDP mesh resumed on 2 ranks (1x2) and on 2x2 with the same parameters; a dying gasp written by
the survivors of a kill resumed to the end of the run, bitwise."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from conftest import clean_env, kinds, read_events, run_bounded
from ftrun.common import checkpoint as ckpt
from ftrun.rank.dcp import MergedReader, check_coverage, load_sliced, merge_metadata, save_part, write_metadata

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_fsdp.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64})")


# ------------------------------------------------------------------------------ no processes

def _part(chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]], size: dict[str, tuple[int, ...]],
          file: str, with_bytes: bool = True) -> Metadata:
    """A writer's metadata part holding ``chunks`` (``{fqn: [(offsets, sizes)]}``) in ``file``."""
    state, storage = {}, {}
    offset = 0
    for fqn, pieces in chunks.items():
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size[fqn]),
                                           [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in pieces])
        for o, _ in pieces:
            storage[MetadataIndex(fqn, o)] = _StorageInfo(file, offset, 8)
            offset += 8
    if with_bytes:
        state["opt.param_groups"] = BytesStorageMetadata()
        storage[MetadataIndex("opt.param_groups")] = _StorageInfo(file, offset, 8)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def test_writers_parts_merge_into_one_metadata_covering_every_tensor() -> None:
    size = {"w": (4, 2), "norm": (2,)}
    # Two writers hold rows 0-1 and 2-3 of w; "norm" is replicated over their dimension: both wrote it.
    first = _part({"w": [((0, 0), (2, 2))], "norm": [((0,), (2,))]}, size, "__0_0.distcp")
    second = _part({"w": [((2, 0), (2, 2))], "norm": [((0,), (2,))]}, size, "__1_0.distcp")
    merged = merge_metadata([first, second])
    w = merged.state_dict_metadata["w"]
    assert sorted(tuple(c.offsets) for c in w.chunks) == [(0, 0), (2, 0)]
    assert len(merged.state_dict_metadata["norm"].chunks) == 1  # one copy of the replicated chunk
    assert merged.storage_data[MetadataIndex("w", (2, 0))].relative_path == "__1_0.distcp"
    assert merged.storage_data[MetadataIndex("norm", (0,))].relative_path == "__0_0.distcp"  # the first part's
    assert isinstance(merged.state_dict_metadata["opt.param_groups"], BytesStorageMetadata)
    # A writer's part missing: the slices do not cover w.
    with pytest.raises(ValueError, match=r"w: the slices hold 4 of its 8 elements \(a writer's part is missing\)"):
        merge_metadata([first])
    # Parts that disagree on a tensor's size are refused, naming it.
    other = _part({"w": [((0, 0), (3, 2))]}, {"w": (6, 2)}, "__1_0.distcp", with_bytes=False)
    with pytest.raises(ValueError, match="w: part 1 holds a tensor of size"):
        merge_metadata([first, other])
    with pytest.raises(ValueError, match="no metadata part"):
        merge_metadata([])


def test_coverage_refuses_overlaps_and_chunks_outside_the_tensor() -> None:
    check_coverage("w", (4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2)), ((4, 0), (0, 2))])  # an empty slice is fine
    with pytest.raises(ValueError, match=r"w: the chunks at \[1, 0\] and \[0, 0\] overlap"):
        check_coverage("w", (4, 2), [((0, 0), (2, 2)), ((1, 0), (2, 2))])
    with pytest.raises(ValueError, match="lies outside its size"):
        check_coverage("w", (4, 2), [((3, 0), (2, 2))])


def _sliced_checkpoint(root: Path, step: int, value: float) -> Path:
    """A one-writer sliced checkpoint of step ``step`` under ``root`` (a model's weight full of
    ``value``, a replica-state counter in the shard file), completed with its manifest."""
    directory = ckpt.step_dir(root, step)
    info = ckpt.save_shard(directory, 0, {"sched": {"n": step}})
    files = save_part(directory, 0, {"model": {"w": torch.full((4, 2), value)}})
    ckpt.write_manifest(directory, step, 1, [[0]], {0: ckpt.ShardInfo(info.file, info.bytes, info.sha256, tuple(files))})
    return directory


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sliced_manifest_lists_every_file_and_a_damaged_one_is_skipped(tmp_path: Path) -> None:
    older = _sliced_checkpoint(tmp_path, 3, 1.0)
    newer = _sliced_checkpoint(tmp_path, 6, 2.0)
    data = json.loads((newer / ckpt.MANIFEST).read_text())
    assert data["version"] == ckpt.SLICED_VERSION  # an ftrun that reads only version 1 refuses it
    listed = [f["file"] for f in data["shards"]["0"]["dcp"]]
    assert listed == ["dcp/__0_0.distcp", "dcp/__0.metadata"]
    manifest = ckpt.verify(newer)
    assert manifest.sliced and manifest.dcp_parts() == ["dcp/__0.metadata"]
    # The merged reader loads it with plain dcp.load, outside any process group.
    state = {"model": {"w": torch.zeros(4, 2)}}
    dcp.load(state, storage_reader=MergedReader(newer).reader, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.full((4, 2), 2.0))
    # write_metadata leaves DCP's global .metadata: plain dcp.load(checkpoint_id=...) reads it.
    write_metadata(newer)
    again = {"model": {"w": torch.zeros(4, 2)}}
    dcp.load(again, checkpoint_id=str(newer / "dcp"), no_dist=True)
    assert torch.equal(again["model"]["w"], torch.full((4, 2), 2.0))
    # Another model (a name the checkpoint lacks) is the job's mistake, not damage: not a CheckpointError.
    with pytest.raises(RuntimeError, match=r"does not load into this job's models .*Missing key") as refused:
        load_sliced(newer, {"model": {"v": torch.zeros(4, 2)}}, manifest.dcp_parts())
    assert not isinstance(refused.value, ckpt.CheckpointError)
    # One flipped byte in the newer checkpoint's data file: it does not verify, the older one is chosen.
    data_file = newer / "dcp" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: SHA-256 .* \(corrupted\)"):
        ckpt.verify(newer)
    # A rank that loads checks each data file it reads before DCP reads it: the same error.
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: SHA-256 .* \(corrupted\)"):
        load_sliced(newer, {"model": {"w": torch.zeros(4, 2)}}, manifest.dcp_parts(),
                    lambda name: ckpt.check_file(newer, manifest.dcp_file(name)))
    skipped: list[tuple[Path, str]] = []
    assert ckpt.find_latest(tmp_path, lambda p, r: skipped.append((p, r))).directory == older
    assert skipped and skipped[0][0] == data_file
    # A missing metadata part: the checkpoint is incomplete, as a missing shard file is.
    (older / "dcp" / "__0.metadata").unlink()
    with pytest.raises(ckpt.CheckpointError, match="missing shard file"):
        ckpt.verify(older, checksums=False)


def test_a_manifest_naming_a_dcp_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    directory = _sliced_checkpoint(tmp_path, 1, 1.0)
    data = json.loads((directory / ckpt.MANIFEST).read_text())
    data["shards"]["0"]["dcp"][0]["file"] = "../elsewhere.distcp"
    (directory / ckpt.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ckpt.CheckpointError, match=r"malformed manifest .*is not dcp/<name>"):
        ckpt.verify(directory)
    data["shards"]["0"].pop("dcp")  # version 2 with no DCP files
    (directory / ckpt.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ckpt.CheckpointError, match="version 2 manifest whose shards lack DCP files"):
        ckpt.verify(directory)


# ------------------------------------------------------------------------------ real ranks

def _run(cwd: Path, name: str, workers: int, mesh: str, steps: int, flags: tuple[str, ...] = (),
         fault: str | None = None, expect: int = 0, checkpoints: str = "ckpt") -> tuple[str | None, str, Path]:
    """Run examples/train_fsdp.py under ftrun; (params_sha256 or None, stdout, log dir)."""
    log_dir = cwd / name
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(workers), "--master_port", "0", "--plain",
           "--log_dir", str(log_dir), "--tail_worker_log", "0", "--checkpoint_dir", str(cwd / checkpoints), *flags,
           str(SCRIPT), "--mesh", mesh, "--steps", str(steps)]
    proc = run_bounded(cmd, env=clean_env({"FTRUN_FAULT": fault} if fault else None), cwd=cwd, timeout=150)
    assert proc.returncode == expect, f"{name}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    match = FINAL.search(proc.stdout)
    return (match.group(3) if match else None), proc.stdout, log_dir


def _full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sliced checkpoint in ``directory`` (model and optimizer state), whole,
    read in this process (no process group)."""
    metadata = MergedReader(directory).metadata
    state = {fqn: torch.zeros(tuple(md.size), dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, storage_reader=MergedReader(directory).reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """4 ranks, HSDP 2x2, 6 steps, a checkpoint every 3 (steps 2 and 5): (its directory, its params_sha256)."""
    cwd = tmp_path_factory.mktemp("fsdp_sliced")
    digest, _, _ = _run(cwd, "write", 4, "2,2", 6, ("--save_steps", "3"))
    assert digest is not None
    return cwd / "ckpt", digest


@pytest.mark.integration
@pytest.mark.timeout(420)  # with the module's writing run (its fixture)
def test_a_checkpoint_of_four_ranks_resumes_on_two_and_on_the_same_mesh(tmp_path: Path, written: tuple[Path, str]) -> None:
    """The checkpoint of step 5 resumed with the same --steps (no step runs): on 2 ranks (1x2, each
    rank's slice read from both writers' files) and on 2x2, the full parameters are the writing
    run's, bit for bit."""
    root, digest = written
    manifest = ckpt.verify(ckpt.step_dir(root, 5))
    assert manifest.sliced and manifest.replica_groups == [[0, 2], [1, 3]]
    assert manifest.dcp_parts() == ["dcp/__0.metadata", "dcp/__1.metadata"]  # one writer per replica group
    shutil.copytree(ckpt.step_dir(root, 5), tmp_path / "step_000000005")
    resume = ("--resume", str(tmp_path / "step_000000005"))
    on_two, out, log_dir = _run(tmp_path, "two", 2, "1,2", 6, resume)
    assert on_two == digest, out[-3000:]
    log = (log_dir / "worker_1.log").read_text()
    assert "resharded onto this mesh" in log and "per-rank state not carried: rng" in log
    on_four, out, _ = _run(tmp_path, "four", 4, "2,2", 6, resume)
    assert on_four == digest, out[-3000:]


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dying_gasp_of_a_sharded_job_is_sliced_and_resumes_bitwise(tmp_path: Path, written: tuple[Path, str]) -> None:
    """Rank 3 killed before step 4 with no restart left: the survivors (ranks 0 and 1 write, while
    rank 3 is gone) save step 3 in DCP's format; the same command resumes from it, runs steps 4
    and 5 (so AdamW's moments came back too) and ends with the uninterrupted run's parameters.
    Resumed on 2 ranks (2x1) instead and stopped the same way, the job's own dying gasp (rank 0
    alone writes every slice) holds the same tensors, model and optimizer, element for element."""
    _, digest = written
    _, out, log_dir = _run(tmp_path, "gasp", 4, "2,2", 6, ("--max_restarts", "0"),
                           fault="rank=3,step=4,point=before_forward,kind=kill", expect=137)
    saved = kinds(read_events(log_dir), "checkpoint_saved")
    assert [e["detail"]["step"] for e in saved] == [3], out[-3000:]
    gasp = ckpt.step_dir(tmp_path / "ckpt", 3)
    manifest = ckpt.verify(gasp)
    assert manifest.sliced and manifest.reason.startswith("dying gasp")
    resumed, out, _ = _run(tmp_path, "resume", 4, "2,2", 6)
    assert "starting from checkpoint" in out and resumed == digest, out[-3000:]
    _, out, _ = _run(tmp_path, "elsewhere", 2, "2,1", 6, ("--max_restarts", "0", "--resume", str(gasp)),
                     fault="rank=1,step=4,point=before_forward,kind=kill", expect=137, checkpoints="ckpt_2x1")
    again = ckpt.step_dir(tmp_path / "ckpt_2x1", 3)
    assert ckpt.verify(again).replica_groups == [[0, 1]], out[-3000:]
    first, second = _full_tensors(gasp), _full_tensors(again)
    assert sorted(first) == sorted(second) and any(".exp_avg_sq" in k for k in first)
    assert [k for k in first if not torch.equal(first[k], second[k])] == []

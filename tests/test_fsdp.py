"""Sharded models (FSDP2/HSDP) under ftrun: a mesh's replica groups without processes; with 4 real
ranks on a 2x2 HSDP mesh, a fault-free run equals the plain torchrun twin bitwise, and a rank
killed inside FSDP's all-gather, its reduce-scatter or the optimizer is respawned alone (the
survivors keep their processes) and the run ends bitwise equal to the fault-free one."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist

from conftest import FtrunProc, clean_env, kinds, read_events, run_bounded
from once import shared_once
from reference_runs import run_torchrun
from ftrun.rank.group import GroupDown
from ftrun.rank.sharding import (ShardedModels, is_collective_failure, mesh_coordinates, mesh_replica_groups,
                            replica_peers)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_fsdp.py"
TORCHRUN_SCRIPT = ROOT / "examples" / "train_fsdp_torchrun.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64})")
RUN = ["--mesh", "2,2", "--steps", "8"]
LONG = ["--mesh", "2,2", "--steps", "30"]


# --------------------------------------------------------------------------- replicas of a mesh, no processes

def test_hsdp_replicas_hold_the_same_shard_index() -> None:
    assert mesh_replica_groups((2, 2), ("replicate", "shard")) == [[0, 2], [1, 3]]
    assert replica_peers(3, (2, 2), ("replicate", "shard")) == [1]
    assert mesh_coordinates(3, (2, 2)) == (1, 1) and mesh_coordinates(2, (2, 2)) == (1, 0)
    # 2 replica groups of 3 sharding ranks; rank 4 is shard 1 of replica 1.
    assert mesh_replica_groups((2, 3), ("replicate", "shard")) == [[0, 3], [1, 4], [2, 5]]
    # HSDP x TP: same shard and tensor-parallel coordinates.
    assert mesh_replica_groups((2, 1, 2), ("replicate", "shard", "tp")) == [[0, 2], [1, 3]]


def test_without_a_replicating_dimension_every_rank_is_alone() -> None:
    assert mesh_replica_groups((1, 4), ("replicate", "shard")) == [[0], [1], [2], [3]]
    assert mesh_replica_groups((2, 2), ("shard", "tp")) == [[0], [1], [2], [3]]
    assert replica_peers(1, (4,), ("shard",)) == []
    # Another name for the replicating dimension, given explicitly.
    assert mesh_replica_groups((2, 2), ("dp", "tp"), replicate_dims=("dp",)) == [[0, 2], [1, 3]]


def test_a_mesh_that_does_not_fit_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="one distinct name per dimension"):
        mesh_replica_groups((2, 2), ("replicate",))
    with pytest.raises(ValueError, match="outside a mesh"):
        mesh_coordinates(4, (2, 2))
    models = ShardedModels(((2, 2), ("replicate", "shard")), "gloo", None, lambda build: build(), lambda pg: None)
    with pytest.raises(ValueError, match="holds 4 ranks; the job has 8"):
        models.replica_groups(8)
    with pytest.raises(ValueError, match="declared shape"):
        models.device_mesh((4,), ("shard",))
    undeclared = ShardedModels(None, "gloo", None, lambda build: build(), lambda pg: None)
    assert undeclared.replica_groups(4) is None
    with pytest.raises(ValueError, match="declare the mesh at ftrun.init"):
        undeclared.device_mesh()


def test_collective_failures_are_told_from_bugs() -> None:
    assert is_collective_failure(dist.DistBackendError("peer gone"))
    assert is_collective_failure(GroupDown("down"))
    assert is_collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("gloo"))


# One process on torch's fake backend (no communication): rank 3 of an HSDP 2x2 mesh, shard index 1.
_ADAPTERS = """
import torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from ftrun.rank.sharding import LocalOptimizerState, LocalShards

dist.init_process_group("fake", store=dist.HashStore(), rank=3, world_size=4)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

def build(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)

a, opt_a = build(0)
for p in a.parameters():
    p.grad = DTensor.from_local(torch.full_like(p.to_local(), 0.5), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
opt_a.step()
b, opt_b = build(1)  # another init, an optimizer that never stepped: a respawned rank's
LocalShards(b).load_state_dict(LocalShards(a).state_dict())
LocalOptimizerState(opt_b).load_state_dict(LocalOptimizerState(opt_a).state_dict())
for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
    assert torch.equal(pa.to_local(), pb.to_local()), n
sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
assert sa.keys() == sb.keys() and len(sa) == 4
for k in sa:
    for name in ("exp_avg", "exp_avg_sq", "step"):
        va, vb = sa[k][name], sb[k][name]
        assert type(va) is type(vb), (name, type(va), type(vb))
        la = va.to_local() if isinstance(va, DTensor) else va
        lb = vb.to_local() if isinstance(vb, DTensor) else vb
        assert torch.equal(la, lb), name
assert all(isinstance(v, torch.Tensor) and not isinstance(v, DTensor) for v in LocalOptimizerState(opt_a).state_dict()["state"][0].values())
print("ok", sorted((n, tuple(v.shape)) for n, v in LocalShards(a).state_dict().items()))
"""


def test_local_shards_and_adamw_state_load_into_a_rank_that_never_stepped(tmp_path: Path) -> None:
    """What a donor sends is plain local tensors (the shards of this rank's index, padded shards
    included); loaded into another model and an AdamW that never stepped, they give the same
    shards and the same moments, wrapped again as DTensors on the parameters' mesh."""
    proc = run_bounded([sys.executable, "-c", _ADAPTERS], env=clean_env({"PYTHONPATH": str(ROOT)}), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ok [('0.bias', (2,)), ('0.weight', (2, 6)), ('1.bias', (1,)), ('1.weight', (1, 5))]" in proc.stdout


# --------------------------------------------------------------------------- 4 real ranks

def _final(stdout: str) -> str:
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-3000:]}"
    return match.group(3)


def _twin(cwd: Path, run: list[str]) -> str:
    """params_sha256 of the plain torchrun twin on 4 ranks."""
    env = clean_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"})
    proc = run_torchrun(["--standalone", "--nproc_per_node", "4", str(TORCHRUN_SCRIPT), *run], env, cwd, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return _final(proc.stdout)


@pytest.fixture(scope="module")
def twin_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the plain torchrun twin, 4 ranks, HSDP 2x2."""
    return shared_once(tmp_path_factory, "fsdp_twin", lambda: _twin(tmp_path_factory.mktemp("fsdp_torchrun"), RUN))


def _ftrun(tmp_path: Path, name: str, fault: str | None, run: list[str] = RUN,
           flags: tuple[str, ...] = ()) -> tuple[str, list[dict]]:
    log_dir = tmp_path / name
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain", "--log_dir", str(log_dir),
           "--tail_worker_log", "0", *flags, str(SCRIPT), *run]
    env = clean_env({"FTRUN_FAULT": fault} if fault else None)
    proc = run_bounded(cmd, env=env, cwd=tmp_path, timeout=150)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    return _final(proc.stdout), read_events(log_dir)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_ftrun_script_under_plain_torchrun_equals_its_twin(tmp_path: Path, twin_digest: str) -> None:
    """Outside ftrun the worker library falls back: ft.device_mesh() is init_device_mesh on torchrun's group."""
    env = clean_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"})
    proc = run_torchrun(["--standalone", "--nproc_per_node", "4", str(SCRIPT), *RUN], env, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _final(proc.stdout) == twin_digest


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_hsdp_without_faults_equals_the_torchrun_twin(tmp_path: Path, twin_digest: str) -> None:
    digest, events = _ftrun(tmp_path, "clean", None)
    assert digest == twin_digest
    assert not kinds(events, "rank_failed") and not kinds(events, "recovery_started")


@pytest.fixture(scope="module")
def twin_long(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the plain torchrun twin, 4 ranks, HSDP 2x2, LONG's 30 steps."""
    return shared_once(tmp_path_factory, "fsdp_twin_long", lambda: _twin(tmp_path_factory.mktemp("fsdp_torchrun_long"), LONG))


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_hsdp_ranks_killed_inside_each_collective_and_from_outside_are_respawned_alone_and_end_bitwise(
        tmp_path: Path, ftrun_proc, twin_long: str) -> None:
    """One job, four faults: rank 2 killed inside the all-gathers of step 2, rank 1 inside the
    reduce-scatters of step 4, rank 3 inside the optimizer of step 6, then rank 0 by a SIGKILL
    from outside, wherever it is. Each is one recovery that respawns that rank alone, its donor
    the rank with its shard index in the other replica group, and the replicas' local shards
    agree afterwards; the run ends as the twin's."""
    faults = [(2, 2, "allgather"), (1, 4, "reduce_scatter"), (3, 6, "optimizer")]
    log_dir = tmp_path / "kills"
    proc = ftrun_proc(["--worker_num", "4", "--master_port", "0", "--plain", "--log_dir", str(log_dir), "--tail_worker_log", "0",
                       "--max_restarts", "4", str(SCRIPT), *LONG],
                      env={"FTRUN_FAULT": "; ".join(f"rank={r},step={s},point={p},kind=kill" for r, s, p in faults)})
    _wait_for_event(proc, log_dir, lambda ev: len(kinds(ev, "recovery_finished")) == 3, timeout=300)
    os.kill(next(e["pid"] for e in read_events(log_dir) if e["kind"] == "rank_started" and e["rank"] == 0), signal.SIGKILL)
    result = proc.wait(timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    events = read_events(log_dir)
    started = kinds(events, "rank_started")
    assert sorted(e["rank"] for e in started) == [0, 0, 1, 1, 2, 2, 3, 3]  # only the killed ranks again
    assert len(kinds(events, "recovery_finished")) == 4 and not kinds(events, "job_restarting")
    for rank, _step, _point in faults + [(0, None, "outside")]:
        recovered = [e for e in kinds(events, "rank_recovered") if e["rank"] == rank and "recipient" in e["message"]]
        donor = replica_peers(rank, (2, 2), ("replicate", "shard"))[0]
        assert recovered, f"rank {rank} was not a recipient"
        assert any(e["rank"] == donor and "donor" in e["message"] for e in kinds(events, "rank_recovered")
                   if e["generation"] == recovered[0]["generation"]), f"rank {rank}'s donor was not {donor}"
    assert not kinds(events, "divergence")  # replicas compared their local shards after each recovery
    assert _final(result.stdout) == twin_long


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_tensor_parallel_by_data_parallel_ranks_killed_everywhere_end_bitwise(tmp_path: Path, ftrun_proc) -> None:
    """TP 2 x DP 2 (mesh (replicate=2, shard=1, tp=2)): ranks 0 and 2 hold the same tensor-parallel
    slice, ranks 1 and 3 the other. Without a fault the run equals the twin; in one job rank 2 is
    killed inside the all-gathers, rank 1 inside the reduce-scatters, rank 3 inside the optimizer,
    then rank 0 by a SIGKILL from outside: each is respawned alone and takes its replica's slice,
    and the run ends as the twin's."""
    run = ["--mesh", "2,1", "--tp", "2", "--steps", "30"]
    twin = _twin(tmp_path, run)
    assert _ftrun(tmp_path, "tp_clean", None, run)[0] == twin
    log_dir = tmp_path / "tp_kills"
    faults = ("rank=2,step=2,point=allgather,kind=kill; rank=1,step=4,point=reduce_scatter,kind=kill; "
              "rank=3,step=6,point=optimizer,kind=kill")
    proc = ftrun_proc(["--worker_num", "4", "--master_port", "0", "--plain", "--log_dir", str(log_dir), "--tail_worker_log", "0",
                       "--max_restarts", "4", str(SCRIPT), *run], env={"FTRUN_FAULT": faults})
    _wait_for_event(proc, log_dir, lambda ev: len(kinds(ev, "recovery_finished")) == 3, timeout=300)
    os.kill(next(e["pid"] for e in read_events(log_dir) if e["kind"] == "rank_started" and e["rank"] == 0), signal.SIGKILL)
    result = proc.wait(timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    events = read_events(log_dir)
    assert sorted(e["rank"] for e in kinds(events, "rank_started")) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(kinds(events, "recovery_finished")) == 4 and not kinds(events, "job_restarting")
    for e in kinds(events, "rank_recovered"):
        if "recipient" in e["message"]:  # each took the slice of the rank with its tensor-parallel coordinate
            assert any(d["rank"] == replica_peers(e["rank"], (2, 1, 2), ("replicate", "shard", "tp"))[0] and "donor" in d["message"]
                       for d in kinds(events, "rank_recovered") if d["generation"] == e["generation"])
    assert _final(result.stdout) == twin


def _wait_for_event(proc: FtrunProc, log_dir: Path, found: Callable[[list[dict]], bool], timeout: float = 120.0) -> None:
    """Until the job's events satisfy ``found``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, f"ftrun exited first:\n{proc.stdout()[-3000:]}"
        if (log_dir / "events.jsonl").exists() and found(read_events(log_dir)):
            return
        time.sleep(0.05)
    pytest.fail(f"the event awaited did not come within {timeout} s")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_pure_fsdp_rolls_every_rank_back_in_place_and_ends_bitwise(tmp_path: Path, ftrun_proc) -> None:
    """No replica (mesh 1x4), checkpoints every 4 steps: once a checkpoint is complete, rank 2 is
    killed inside the reduce-scatters; once the job recovered and wrote another, rank 0 inside the
    all-gathers. Each time every rank keeps its process (the killed one is respawned) and loads
    its own part of the newest checkpoint, with no whole-job restart; the steps computed again
    are reported, and the run ends as the twin's."""
    run = ["--mesh", "1,4", "--steps", "40"]
    go = [tmp_path / "kill_rank2", tmp_path / "kill_rank0"]
    log_dir = tmp_path / "logs"
    proc = ftrun_proc(["--worker_num", "4", "--master_port", "0", "--plain", "--log_dir", str(log_dir), "--tail_worker_log", "0",
                       "--save_steps", "4", "--checkpoint_dir", str(tmp_path / "ckpt"), str(SCRIPT), *run],
                      env={"FTRUN_FAULT": f"rank=2,point=reduce_scatter,kind=kill,when={go[0]}; "
                                          f"rank=0,point=allgather,kind=kill,when={go[1]}"})
    _wait_for_event(proc, log_dir, lambda ev: bool(kinds(ev, "checkpoint_saved")))
    go[0].touch()
    _wait_for_event(proc, log_dir, lambda ev: bool(kinds(ev, "recovery_finished")) and
                    kinds(ev, "checkpoint_saved")[-1]["time"] > kinds(ev, "recovery_finished")[0]["time"])
    go[1].touch()
    result = proc.wait(timeout=200)
    assert result.returncode == 0, result.stdout[-4000:]
    events = read_events(log_dir)
    assert sorted(e["rank"] for e in kinds(events, "rank_started")) == [0, 0, 1, 2, 2, 3]
    assert not kinds(events, "job_restarting")
    finished = kinds(events, "recovery_finished")
    assert len(finished) == 2 and all("rolled back" in e["message"] for e in finished)
    saved = {e["detail"]["step"] for e in kinds(events, "checkpoint_saved")}
    for done, began in zip(finished, kinds(events, "recovery_started")):
        # Back to the newest checkpoint complete when the rollback was planned, the steps after it
        # redone: at least the newest whose event came before the fault (one completed as the fault
        # came may be announced after the recovery began, and is then the newest).
        newest = max(e["detail"]["step"] for e in kinds(events, "checkpoint_saved") if e["time"] <= began["time"])
        back_to = done["detail"]["resume_step"] - 1
        assert back_to in saved and back_to >= newest, ([e["message"] for e in finished], sorted(saved), newest)
        assert done["detail"]["redone_steps"] >= 0
    assert _final(result.stdout) == _twin(tmp_path, run)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_hsdp_rank_hung_inside_the_allgathers_is_found_and_replaced(tmp_path: Path, twin_long: str) -> None:
    """Rank 1 loops in Python between FSDP's all-gathers; its peers wait in torch.distributed. The
    watchdog blames rank 1 alone (a sharded model's forward is announced as a collective), the
    kill releases the others, and the run ends bitwise. At step 15: the step bound needs its warm-up."""
    digest, events = _ftrun(tmp_path, "hang", "rank=1,step=15,point=allgather,kind=hang", LONG)
    assert [e["rank"] for e in kinds(events, "rank_hung")] == [1]
    assert sorted(e["rank"] for e in kinds(events, "rank_started")) == [0, 1, 1, 2, 3]
    assert digest == twin_long

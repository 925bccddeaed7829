"""Two pytorch/examples scripts ported to the worker library as a user would, each against its
plain-torchrun twin, bitwise, without and with a fault inside a step of a shape the other examples
do not have:

- dcgan (examples/dcgan.py, twin dcgan_torchrun.py; 4 ranks, 3 epochs of 8 steps): two models
  with BatchNorm, both in DDP (rank 0's buffers broadcast before every forward), two optimizers,
  three backward passes and two updates a step. The digest covers both nets' parameters and
  buffers. Faulted: rank 2 killed in the second update (``optimizerG.step()``) of a mid-epoch
  step, after every rank applied the first (``optimizerD.step()``).
- time_sequence_prediction (examples/time_sequence_prediction.py, twin
  time_sequence_prediction_torchrun.py; 2 ranks, 3 steps): LBFGS, whose ``step(closure)`` runs
  the closure's forward and backward (and its gradient all-reduce) up to 20 times in one update,
  changing the parameters between calls. Faulted: rank 1 killed in the all-reduce of the second
  closure call of step 1.

More scenarios (kills at every point and ``nth``, outside SIGKILLs, epoch edges, the unregistered
netG variant, ``ftrun check``) are in scripts/check_ports.py, too long for the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from once import shared_once
import pytest
from reference_runs import run_torchrun
from conftest import clean_env
from example_jobs import assert_recovered_in_place, final_digest, job_events

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DCGAN_RANKS = 4
DCGAN_ARGS = ["--niter", "3"]  # 128 images, 4 a batch: 8 steps an epoch on 4 ranks, steps 0..23
TSP_RANKS = 2
TSP_ARGS = ["--steps", "3", "--length", "60"]

pytestmark = pytest.mark.integration


def _torchrun_digest(cwd: Path, script: str, ranks: int, args: list[str]) -> str:
    """The digest of ``script`` under plain torchrun (DDP, no ftrun)."""
    proc = run_torchrun(["--standalone", "--nproc_per_node", str(ranks), str(EXAMPLES / script), *args], env=clean_env(), cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return final_digest(proc.stdout)


def _run_ftrun(tmp_path: Path, script: str, ranks: int, args: list[str], fault: str | None = None) -> tuple[str, list[dict]]:
    """Run ``script`` under ftrun on ``ranks`` ranks (with ``FTRUN_FAULT=fault``); returns
    (digest, events). Asserts exit code 0."""
    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(ranks), "--master_port", "0", "--plain",
           "--log_dir", str(log_dir), "--tail_worker_log", "0", "--max_restarts", "3", str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, env=clean_env({"FTRUN_FAULT": fault} if fault else None), capture_output=True, text=True,
                          timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    return final_digest(proc.stdout), job_events(log_dir)


def _divergences(events: list[dict]) -> list[str]:
    return [e["message"] for e in events if e["kind"] == "divergence"]


@pytest.fixture(scope="module")
def dcgan_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """dcgan_torchrun.py's digest (netG's and netD's parameters and buffers; plain DDP)."""
    return shared_once(tmp_path_factory, "dcgan_reference", lambda: _torchrun_digest(
        tmp_path_factory.mktemp("dcgan_torchrun"), "dcgan_torchrun.py", DCGAN_RANKS, DCGAN_ARGS))


@pytest.fixture(scope="module")
def tsp_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """time_sequence_prediction_torchrun.py's digest (plain DDP)."""
    return shared_once(tmp_path_factory, "tsp_reference", lambda: _torchrun_digest(
        tmp_path_factory.mktemp("tsp_torchrun"), "time_sequence_prediction_torchrun.py", TSP_RANKS, TSP_ARGS))


def test_dcgan_matches_torchrun_twin(tmp_path: Path, dcgan_reference: str) -> None:
    """Fault-free: both nets' parameters and BatchNorm buffers are the twin's, bitwise, and no
    step is reported as diverged (three backward passes and two updates a step are one step)."""
    digest, events = _run_ftrun(tmp_path, "dcgan.py", DCGAN_RANKS, DCGAN_ARGS)
    assert not _divergences(events)
    assert not [e for e in events if e["kind"] == "rank_failed"]
    assert digest == dcgan_reference


def test_dcgan_kill_in_second_update(tmp_path: Path, dcgan_reference: str) -> None:
    """Rank 2 killed in ``optimizerG.step()`` of step 11 (epoch 1's fourth), after every rank
    applied ``optimizerD.step()`` of that step: the survivors' first update of step 11 must not
    count twice, nor their BatchNorm buffers' updates of its forwards, when the step is computed
    again; only rank 2 is respawned, and the run ends with the twin's parameters and buffers."""
    digest, events = _run_ftrun(tmp_path, "dcgan.py", DCGAN_RANKS, DCGAN_ARGS,
                                "rank=2,step=11,point=optimizer,nth=2,kind=kill")
    assert_recovered_in_place(events, {2})
    assert not _divergences(events)
    assert digest == dcgan_reference


def test_time_sequence_prediction_matches_torchrun_twin(tmp_path: Path, tsp_reference: str) -> None:
    """Fault-free: LBFGS's 20 closure calls a step (20 backward passes, 20 all-reduces inside one
    update) give the twin's parameters, bitwise, and no divergence."""
    digest, events = _run_ftrun(tmp_path, "time_sequence_prediction.py", TSP_RANKS, TSP_ARGS)
    assert not _divergences(events)
    assert not [e for e in events if e["kind"] == "rank_failed"]
    assert digest == tsp_reference


def test_time_sequence_prediction_kill_in_closure_allreduce(tmp_path: Path, tsp_reference: str) -> None:
    """Rank 1 killed in the all-reduce of LBFGS's second closure call of step 1, after the survivor
    moved its parameters once inside ``optimizer.step(closure)``: the half-done update must not be
    kept (nor LBFGS's history of it), the step is computed again from its start, and the run ends
    with the twin's parameters."""
    digest, events = _run_ftrun(tmp_path, "time_sequence_prediction.py", TSP_RANKS, TSP_ARGS,
                                "rank=1,step=1,point=allreduce,nth=2,kind=kill")
    assert_recovered_in_place(events, {1})
    assert not _divergences(events)
    assert digest == tsp_reference

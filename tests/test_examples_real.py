"""Real training scripts on the worker library, each against its plain-torchrun twin,
bitwise, without and with faults (2 ranks):

- pytorch/examples' mnist in data-parallel form (examples/mnist.py: an epoch loop over a
  DataLoader with a DistributedSampler, Adadelta, StepLR, a test pass each epoch), 2 epochs of 12 steps;
- examples/train_real.py (a StatefulDataLoader, gradient accumulation with no_sync(),
  clip_grad_norm_, AdamW with OneCycleLR stepped every step, a slow evaluation in a section),
  3 epochs of 11 steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import digits_job as dj
from once import shared_once
import pytest
from example_jobs import (EXAMPLES, MNIST_ARGS, assert_recovered_in_place as _assert_recovered_in_place, clean_env as _env,
                          final_digest as _digest, job_events as _events, mnist_reference, torchrun_digest as _torchrun_digest)  # noqa: F401

REAL_ARGS = ["--epochs", "3", "--eval_every", "15", "--log_every", "5"]

pytestmark = pytest.mark.integration


def _ftrun_cmd(log_dir: Path, script: str, args: list[str], ftrun_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", "2", "--master_port", "0", "--plain",
            "--log_dir", str(log_dir), "--tail_worker_log", "0", "--max_restarts", "3", *ftrun_args,
            str(EXAMPLES / script), *args]


def _run_ftrun(tmp_path: Path, script: str, args: list[str], fault: str | None = None,
               ftrun_args: tuple[str, ...] = ()) -> tuple[str, list[dict]]:
    log_dir = tmp_path / "logs"
    proc = subprocess.run(_ftrun_cmd(log_dir, script, args, ftrun_args), env=_env({"FTRUN_FAULT": fault} if fault else None),
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    return _digest(proc.stdout), _events(log_dir)


def _kill_rank_when(tmp_path: Path, script: str, args: list[str], line: str, rank: int) -> tuple[str, list[dict]]:
    """Run ``script`` under ftrun, SIGKILL ``rank``'s first process from outside once rank 0's log
    shows ``line``, and let the job end; returns (digest, events). Asserts exit code 0."""
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(log_dir, script, args), _env(), tmp_path, log_dir, line, rank)
    return _digest(out), _events(log_dir)


@pytest.fixture(scope="module")
def real_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """train_real_torchrun.py's parameters (plain DDP, no ftrun)."""
    return shared_once(tmp_path_factory, "real_reference", lambda: _torchrun_digest(
        tmp_path_factory.mktemp("real_torchrun"), "train_real_torchrun.py", REAL_ARGS))


def test_mnist_matches_torchrun_twin(tmp_path: Path, mnist_reference: str) -> None:
    digest, events = _run_ftrun(tmp_path, "mnist.py", MNIST_ARGS)
    assert digest == mnist_reference
    assert not [e for e in events if e["kind"] == "rank_failed"]


def test_mnist_outside_sigkill_mid_epoch(tmp_path: Path, mnist_reference: str) -> None:
    """SIGKILL of rank 1 from outside in epoch 2: only rank 1 is respawned; it resumes in epoch 2
    at its predecessor's place in the DataLoader with its RNG (dropout), and the run ends bitwise
    equal to the twin's."""
    digest, events = _kill_rank_when(tmp_path, "mnist.py", MNIST_ARGS, "Train Epoch: 2 [256/", rank=1)
    assert digest == mnist_reference
    _assert_recovered_in_place(events, {1})
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [1]


# Faults at an epoch boundary of ft.epochs()/ft.batches(). Both once diverged: the retried first
# step of a pass lost iter()'s seed draw (dropout shifted), and a recipient an epoch behind its
# donor kept the learning rate its own scheduler.step() set at the epoch's end.
@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "rank=1,step=12,point=allreduce,kind=kill",        # the first step of epoch 2
    "rank=1,step=11,point=optimizer,kind=recoverable",  # the last step of epoch 1: peers commit it
    # A rank replaced after the last step of epoch 1 (before the test pass) or before the
    # first forward of epoch 2 (after it). The test pass's iter(test_loader) drew a seed from torch's
    # global generator: the first lost that draw (now the loader has its own generator), the second
    # took its predecessor's state from before the epoch's end (now recorded after it).
    "rank=1,step=11,point=between_steps,kind=kill",
    "rank=1,step=12,point=before_forward,kind=kill",
])
def test_mnist_injected_faults(tmp_path: Path, mnist_reference: str, fault: str) -> None:
    digest, events = _run_ftrun(tmp_path, "mnist.py", MNIST_ARGS, fault)
    assert digest == mnist_reference
    assert [e for e in events if e["kind"] == "recovery_finished"]
    assert not [e["message"] for e in events if e["kind"] == "divergence"]


def test_train_real_matches_torchrun_twin_through_a_slow_evaluation(tmp_path: Path, real_reference: str) -> None:
    """Fault-free, with each evaluation (in ``ft.section``) taking 3 s, over the 2 s step bound
    this test sets: no rank is taken for hung, and the parameters are the twin's, bitwise."""
    digest, events = _run_ftrun(tmp_path, "train_real.py", [*REAL_ARGS, "--eval_pause", "3"],
                                ftrun_args=("--step_timeout_min", "2"))
    assert digest == real_reference
    assert not [e for e in events if e["kind"] in ("rank_failed", "rank_hung")], [e["message"] for e in events if e["kind"] == "rank_hung"]


def test_train_real_outside_sigkill(tmp_path: Path, real_reference: str) -> None:
    """SIGKILL of rank 1 from outside in epoch 2: only rank 1 is respawned, resumes at its
    predecessor's place in the StatefulDataLoader, and the run ends bitwise equal to the twin's."""
    digest, events = _kill_rank_when(tmp_path, "train_real.py", REAL_ARGS, "epoch 1 step 15 ", rank=1)
    assert digest == real_reference
    _assert_recovered_in_place(events, {1})
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "rank=1,step=11,point=allreduce,kind=kill",         # the first step of epoch 2, at its synced micro-batch
    "rank=0,step=14,point=optimizer,kind=recoverable",  # a step with an evaluation after its update (UCE)
    "rank=1,step=21,point=between_steps,kind=kill",     # after a committed step, the last of epoch 2
    "rank=0,step=26,point=before_forward,kind=kill",    # rank 0, before its micro-batches
])
def test_train_real_injected_faults(tmp_path: Path, real_reference: str, fault: str) -> None:
    digest, events = _run_ftrun(tmp_path, "train_real.py", REAL_ARGS, fault)
    assert digest == real_reference
    assert [e for e in events if e["kind"] == "recovery_finished"]

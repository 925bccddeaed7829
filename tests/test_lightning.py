"""PyTorch Lightning under ftrun: examples/lightning_trainer.py with ``FTStrategy``
(ftrun.integrations.lightning) on 4 ranks against the same script with Lightning's own
``DDPStrategy`` under torchrun, bitwise (the parameters' SHA-256, the last validation loss and
``ModelCheckpoint``'s best score and file), without and with a rank SIGKILLed from outside:
mid-epoch, at an epoch boundary and during a validation; the survivors keep their processes.

The job: a small classifier on synthetic points, 12 micro-batches an epoch per rank (192 samples,
4 ranks, micro-batches of 4), gradient accumulation 2 (6 steps an epoch), 2 epochs, validation
every 4 micro-batches (after steps 2, 4, 6, 8, 10 and 12: mid-epoch and at each epoch's end), AdamW with a per-step schedule, clipping at 1.0,
``ModelCheckpoint`` keeping the two best. One torchrun run is the reference of every test
(module-scoped); one recovery runs in CI, the rest are ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import digits_job as dj
from once import shared_once
import pytest
from reference_runs import run_torchrun

pytest.importorskip("lightning", reason="the lightning extra (pip install 'ftrun[lightning]') is not installed")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "lightning_trainer.py"
FINAL = re.compile(r"final step=(\d+) epoch=(\d+) val_loss=(\S+) best=(\S+) best_path=(\S+) params_sha256=([0-9a-f]{64})")
ARGS = ["--max_epochs", "2", "--train_size", "192", "--val_every", "4", "--accum", "2"]
WORLD = 4

pytestmark = [pytest.mark.integration, pytest.mark.frameworks, pytest.mark.xdist_group("lightning")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return env


def _final(stdout: str) -> tuple[str, ...]:
    """(steps, epoch, last validation loss, best score, best file, params digest) from rank 0's final
    line, and each validation's loss (``val step=<n> loss=<x>``, once: a validation run again after
    a fault in ``ModelCheckpoint``'s collectives prints its line twice)."""
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    validations = list(dict.fromkeys(re.findall(r"val step=\d+ loss=\S+", stdout)))
    return (*match.groups(), *validations)


def _first_errors(stderr: str) -> str:
    """The first lines of ``stderr`` that say what went wrong (torchrun's summary, at its end, names
    only the signal)."""
    lines = [line for line in stderr.splitlines() if re.search(r"Error|terminate|Traceback|abort", line)]
    return "\n".join(lines[:20]) + "\n"


def _events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _ftrun_cmd(tmp_path: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", str(WORLD), "--master_port", "0", "--plain",
            "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", "--max_restarts", "3",
            "--step_timeout", "120", str(SCRIPT), "--output_dir", str(tmp_path / "out"), *args]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """Lightning's own ``DDPStrategy`` (``--no_ftrun``) under torchrun, 4 ranks."""
    def run() -> tuple[str, ...]:
        cwd = tmp_path_factory.mktemp("lightning_torchrun")
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT),
                             "--output_dir", str(cwd / "out"), "--no_ftrun", *ARGS], env=_env(), cwd=cwd)
        assert proc.returncode == 0, proc.stdout[-3000:] + _first_errors(proc.stderr) + proc.stderr[-3000:]
        final = _final(proc.stdout)
        assert final[0] == "12" and len(final) == 6 + 6, final  # 12 steps, a validation every 2
        return final

    return tuple(shared_once(tmp_path_factory, "lightning_reference", run))


def _kill_when(tmp_path: Path, line: str, rank: int, args: list[str]) -> tuple[tuple[str, ...], list[dict]]:
    """Run the script under ftrun; once rank 0's log shows ``line``, SIGKILL ``rank``'s first process
    from outside; returns (final line, events). Asserts exit code 0."""
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(tmp_path, args), _env(), tmp_path, log_dir, line, rank)
    return _final(out), _events(log_dir)


def _assert_recovered_in_place(events: list[dict], faulted: int) -> None:
    """Only ``faulted`` was restarted (the survivors' PIDs never changed), once, by a rank-level
    recovery (no whole-job restart), and no exactly-once check reported a divergence."""
    pids: dict[int, list[int]] = {}
    for ev in events:
        if ev["kind"] == "rank_started":
            pids.setdefault(ev["rank"], []).append(ev["pid"])
    assert sorted(pids) == list(range(WORLD))
    for rank, started in pids.items():
        assert len(started) == (2 if rank == faulted else 1), f"rank {rank}: {started}"
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [faulted]
    assert not [e for e in events if e["kind"] == "job_restarting"], "fell back to a whole-job restart"
    assert [e for e in events if e["kind"] == "recovery_finished"], "no recovery finished"
    assert not [e.get("message") for e in events if e["kind"] == "divergence"]


def test_lightning_sigkill_mid_epoch(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """Rank 2 SIGKILLed while rank 0 pauses after step 1 (of 6 in epoch 0): rank 2 dies in step 2's
    gradient all-reduce (its second micro-batch), the survivors put back the first micro-batch's
    gradients and run the second again, the new rank resumes at its replicas' step and place in
    the epoch through Lightning's restart, and the job ends with the reference's parameters,
    validation loss and best checkpoint, bitwise."""
    final, events = _kill_when(tmp_path, "pause step_end step=1", rank=2, args=[*ARGS, "--pause_on", "step_end:1"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=2)


@pytest.mark.slow
def test_lightning_fault_free_matches_torchrun(tmp_path: Path, reference: tuple[str, ...]) -> None:
    proc = subprocess.run(_ftrun_cmd(tmp_path, ARGS), env=_env(), capture_output=True, text=True, timeout=280,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    assert not [e for e in _events(tmp_path / "logs") if e["kind"] in ("rank_failed", "divergence")]


@pytest.mark.slow
def test_lightning_sigkill_at_epoch_boundary(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """Rank 1 SIGKILLed while rank 0 pauses at the end of epoch 0 (step 6, after its validation):
    the others are in epoch 1's first step; the new rank starts epoch 1 (no batch to drop) with its
    predecessor's streams, and rank 0, which finds the abort at that step's start, rolls back no
    further than there."""
    final, events = _kill_when(tmp_path, "pause epoch_end step=6", rank=1, args=[*ARGS, "--pause_on", "epoch_end:6"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=1)


@pytest.mark.slow
@pytest.mark.parametrize("step", [4, 6])
def test_lightning_sigkill_during_validation(tmp_path: Path, reference: tuple[str, ...], step: int) -> None:
    """Rank 3 SIGKILLed during the validation after step 4 (mid-epoch) or step 6 (an epoch's last
    batch): rank 0 pauses in its first validation batch, the others wait in the validation's
    metric all-reduce. The survivors roll the validation back to its start and run it again with
    the new rank, which restarts in it (Lightning's ``restarted_mid_evaluation``) before its first
    step, in the epoch it belongs to (at step 6 it then runs epoch 0's end)."""
    final, events = _kill_when(tmp_path, f"pause eval step={step}", rank=3, args=[*ARGS, "--pause_on", f"eval:{step}"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=3)


def test_lightning_resume_refuses_a_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    from ftrun.integrations.lightning_resume import main

    assert main([]) == 2
    assert main(["/nonexistent/train.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "ftrun.integrations.lightning_resume: no such script: /nonexistent/train.py"


def test_lightning_resume_picks_the_newest_checkpoint_of_a_restarted_attempt(tmp_path: Path) -> None:
    """Only a restarted attempt resumes, from the newest ``*.ckpt`` (modification time) of the
    ``ModelCheckpoint`` directories; other files and a missing directory are ignored."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ftrun.integrations.lightning_resume import checkpoint_to_resume

    class FakeTrainer:
        default_root_dir = str(tmp_path / "root")
        checkpoint_callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "a")), ModelCheckpoint(dirpath=str(tmp_path / "none"))]

    (tmp_path / "a").mkdir()
    for i, name in enumerate(["epoch=0-step=2.ckpt", "last.ckpt", "epoch=0-step=4.ckpt", "notes.txt"]):
        (tmp_path / "a" / name).write_text(name)
        os.utime(tmp_path / "a" / name, (1000 + i, 1000 + i))
    assert checkpoint_to_resume(FakeTrainer(), {}) is None
    assert checkpoint_to_resume(FakeTrainer(), {"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert checkpoint_to_resume(FakeTrainer(), {"TORCHELASTIC_RESTART_COUNT": "1"}) == str(tmp_path / "a" / "epoch=0-step=4.ckpt")
    FakeTrainer.checkpoint_callbacks = [ModelCheckpoint()]  # no dirpath: default_root_dir/checkpoints, absent
    assert checkpoint_to_resume(FakeTrainer(), {"TORCHELASTIC_RESTART_COUNT": "1"}) is None


@pytest.mark.slow
def test_unmodified_script_restart_resumes_from_newest_checkpoint(tmp_path: Path) -> None:
    """The plain Lightning script (``--no_ftrun``, one process, 24 steps an epoch,
    ``ModelCheckpoint`` keeping the two best) run through ``ftrun.integrations.lightning_resume``.
    The first attempt trains epoch 0 and stops (as a fault right after its last save would); a
    restarted attempt (``TORCHELASTIC_RESTART_COUNT=1``) asked for 2 epochs resumes from the newest
    checkpoint (step 24, epoch 0's end) and trains epoch 1's steps only."""
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cmd = [sys.executable, "-m", "ftrun.integrations.lightning_resume", str(SCRIPT), "--no_ftrun", "--train_size", "192",
           "--val_every", "4", "--accum", "2", "--output_dir", str(tmp_path / "out")]
    first = subprocess.run([*cmd, "--max_epochs", "1"], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resuming from" not in first.stderr and "final step=24 " in first.stdout
    newest = max((tmp_path / "out" / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert newest.name == "epoch=0-step=24.ckpt"
    again = subprocess.run([*cmd, "--max_epochs", "2"], env={**env, "TORCHELASTIC_RESTART_COUNT": "1"},
                           capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"ftrun: attempt 1: resuming from {newest}" in again.stderr
    steps = [int(s) for s in re.findall(r"^log step=(\d+) ", again.stdout, re.M)]
    assert steps == list(range(25, 49)), steps  # epoch 0's steps were not trained again
    assert "final step=48 epoch=2 " in again.stdout

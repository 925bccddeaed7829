"""Hugging Face ``Trainer`` under ftrun: examples/hf_trainer.py with
``FTTrainer`` (ftrun.integrations.hf) on 4 ranks against the same script with the plain ``Trainer``
under torchrun, bitwise (the parameters' SHA-256 and the final evaluation loss), without and with a
rank SIGKILLed from outside:
mid-epoch, at an epoch boundary and during an evaluation; the survivors keep their processes.

The job: a tiny GRU language model on synthetic tokens, 4 steps an epoch (128 samples, 4 ranks,
micro-batches of 4, gradient accumulation 2), 10 steps, logging every 2, evaluation every 5,
AdamW with a cosine schedule and warm-up, clipping at 1.0. One torchrun run is the reference of
every test (module-scoped); one recovery runs in CI, the rest are ``slow``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import digits_job as dj
from framework_helpers import assert_recovered_in_place, events as _events, hf_env as _env
from once import shared_once
import pytest
from reference_runs import run_torchrun

pytest.importorskip("transformers", reason="the hf extra (pip install 'ftrun[hf]') is not installed")
pytest.importorskip("accelerate", reason="the hf extra (pip install 'ftrun[hf]') is not installed")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "hf_trainer.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) test_accuracy=(\S+) params_sha256=([0-9a-f]{64}) "
                   r"logs_sha256=([0-9a-f]{64})")
ARGS = ["--max_steps", "10", "--train_size", "128", "--eval_steps", "5", "--accum", "2"]
WORLD = 4

pytestmark = [pytest.mark.integration, pytest.mark.frameworks, pytest.mark.xdist_group("hf")]


def _final(stdout: str) -> tuple[int, str, str, str]:
    """(steps, eval loss, params digest, log history digest) from rank 0's final line.

    The log history (logged losses, grad norms, learning rates, evaluations) differed twice in 16
    faulted runs under load, with the reference's parameters, before a rank's record after an
    evaluation or a save was waited for (b762c66); since then it matched in 12 of 12 faulted runs
    (mid-epoch, epoch boundary, evaluation, three injected faults; twice, once under load). The
    slow tests compare it; the one CI runs compares the first three (:func:`_trained`) until more
    runs in CI have shown the same."""
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    return int(match.group(1)), match.group(3), match.group(4), match.group(5)


def _trained(final: tuple[int, str, str, str]) -> tuple[int, str, str]:
    """(steps, eval loss, params digest): what training produced, without the log history."""
    return final[:3]


def _ftrun_cmd(tmp_path: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", str(WORLD), "--master_port", "0", "--plain",
            "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", "--max_restarts", "3",
            "--step_timeout", "120", str(SCRIPT), "--output_dir", str(tmp_path / "out"), *args]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, str]:
    """The plain ``Trainer`` (``--no_ftrun``: accelerate's own DDP) under torchrun, 4 ranks."""
    def run() -> tuple[int, str, str, str]:
        cwd = tmp_path_factory.mktemp("hf_torchrun")
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT),
                             "--output_dir", str(cwd / "out"), "--no_ftrun", *ARGS], env=_env(), cwd=cwd)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return _final(proc.stdout)

    return tuple(shared_once(tmp_path_factory, "hf_reference", run))


def _kill_when(tmp_path: Path, line: str, rank: int, args: list[str]) -> tuple[tuple[int, str, str, str], list[dict]]:
    """Run the script under ftrun; once rank 0's log shows ``line``, SIGKILL ``rank``'s first process
    from outside; returns (final line, events). Asserts exit code 0."""
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(tmp_path, args), _env(), tmp_path, log_dir, line, rank)
    return _final(out), _events(log_dir)


def _assert_recovered_in_place(events: list[dict], faulted: int) -> None:
    assert_recovered_in_place(events, faulted, WORLD, allow_behind=True)


def test_hf_trainer_sigkill_mid_epoch(tmp_path: Path, reference: tuple[int, str, str, str]) -> None:
    """Rank 2 SIGKILLed while rank 0 pauses after step 1 (of 4 in epoch 0): rank 2 dies in step
    2's gradient all-reduce (its second micro-batch), the survivors retry the step with the
    micro-batches they hold, the new rank resumes at its replicas' step and place in the epoch,
    and the job ends with the reference's parameters and evaluation loss, bitwise."""
    final, events = _kill_when(tmp_path, "pause step_end step=1", rank=2, args=[*ARGS, "--pause_on", "step_end:1"])
    assert _trained(final) == _trained(reference)
    _assert_recovered_in_place(events, faulted=2)


@pytest.mark.slow
def test_hf_trainer_fault_free_matches_torchrun(tmp_path: Path, reference: tuple[int, str, str, str]) -> None:
    proc = subprocess.run(_ftrun_cmd(tmp_path, ARGS), env=_env(), capture_output=True, text=True, timeout=280,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    assert not [e for e in _events(tmp_path / "logs") if e["kind"] in ("rank_failed", "divergence")]


@pytest.mark.slow
def test_hf_trainer_sigkill_at_epoch_boundary(tmp_path: Path, reference: tuple[int, str, str, str]) -> None:
    """Rank 1 SIGKILLed while rank 0 pauses at the end of epoch 0: the others are in epoch 1's
    first step; the new rank starts epoch 1 (no batch to skip) with its predecessor's streams."""
    final, events = _kill_when(tmp_path, "pause epoch_end step=4", rank=1, args=[*ARGS, "--pause_on", "epoch_end:4"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=1)


@pytest.mark.slow
def test_hf_trainer_sigkill_during_evaluation(tmp_path: Path, reference: tuple[int, str, str, str]) -> None:
    """Rank 3 SIGKILLed during the evaluation after step 5 (rank 0 pauses in its first evaluation
    batch; the others wait in the evaluation's gather): the survivors' gather fails, they roll
    back to the start of the step's logging and evaluation and run it again with the new rank,
    which runs it first, before its first step."""
    final, events = _kill_when(tmp_path, "pause eval step=5", rank=3, args=[*ARGS, "--pause_on", "eval:5"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=3)


def test_hf_resume_refuses_a_missing_script(capsys: pytest.CaptureFixture[str]) -> None:
    from ftrun.integrations.hf_resume import main

    assert main([]) == 2
    assert main(["/nonexistent/train.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "ftrun.integrations.hf_resume: no such script: /nonexistent/train.py"


@pytest.mark.slow
def test_unmodified_script_restart_resumes_from_newest_checkpoint(tmp_path: Path) -> None:
    """The plain ``Trainer`` script (one process, 6 steps, ``save_steps`` 3) run
    through ``ftrun.integrations.hf_resume``. A restarted attempt (``TORCHELASTIC_RESTART_COUNT=1``)
    with only ``checkpoint-3`` left resumes from it, trains steps 4-6 only, and ends with the
    parameters of the uninterrupted run (the Trainer's own resume, bitwise on this job)."""
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "ftrun.integrations.hf_resume", str(SCRIPT), "--no_ftrun", "--max_steps", "6",
           "--save_steps", "3", "--eval_steps", "3", "--output_dir", str(tmp_path / "out")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resuming from" not in first.stderr
    import shutil

    shutil.rmtree(tmp_path / "out" / "checkpoint-6")
    again = subprocess.run(cmd, env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}, capture_output=True, text=True,
                           timeout=240, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"ftrun: attempt 1: resuming from {tmp_path / 'out' / 'checkpoint-3'}" in again.stderr
    assert "log step=2 " not in again.stdout and "log step=4 " in again.stdout  # steps 1-3 were not trained again
    assert _final(again.stdout)[2] == _final(first.stdout)[2]  # the log history is not: train_loss covers steps 4-6


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "rank=0,step=3,point=between_steps,kind=kill",   # rank 0 (the donor of choice, the one that logs) after step 3's logging
    "rank=2,step=5,point=before_forward,kind=kill",  # after the evaluation of step 5: its replicas finished it
    "rank=1,step=2,point=allreduce,kind=kill",       # in the all-reduce of the second micro-batch
])
def test_hf_trainer_injected_faults(tmp_path: Path, reference: tuple[int, str, str, str], fault: str) -> None:
    """Faults at ftrun's injection points (docs/fault-injection.md), each bitwise equal."""
    proc = subprocess.run(_ftrun_cmd(tmp_path, ARGS), env={**_env(), "FTRUN_FAULT": fault}, capture_output=True,
                          text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    events = _events(tmp_path / "logs")
    assert [e for e in events if e["kind"] == "recovery_finished"]
    assert not [e.get("message") for e in events if e["kind"] == "divergence"]


@pytest.mark.slow
def test_hf_trainer_gpt2_bf16_sigkill_mid_epoch(tmp_path: Path) -> None:
    """A ``GPT2LMHeadModel`` from a ``GPT2Config`` (its loss averaged over the tokens of all ranks:
    the Trainer gathers each step's item count, a collective a retry makes again) under bf16
    autocast on CPU: rank 1 SIGKILLed mid-epoch ends bitwise equal to the plain Trainer under
    torchrun (its own reference: this job's parameters differ from the others')."""
    args = [*ARGS, "--model", "gpt2", "--bf16"]
    ref = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT),
                        "--output_dir", str(tmp_path / "ref"), "--no_ftrun", *args], env=_env(), cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    final, events = _kill_when(tmp_path, "pause step_end step=1", rank=1, args=[*args, "--pause_on", "step_end:1"])
    assert final == _final(ref.stdout)
    _assert_recovered_in_place(events, faulted=1)

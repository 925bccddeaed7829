"""Accelerate loops under ftrun: examples/accelerate_loop.py's port
(``main_ftrun``, ``ftrun.integrations.accelerate``) on 4 ranks against the loop as written
(``main``) under torchrun, bitwise (the parameters' SHA-256 and the final evaluation loss), without
and with a rank SIGKILLed from outside: mid-epoch, at an epoch boundary and during an evaluation;
the survivors keep their processes.

The job: a small classifier on synthetic data, 4 optimizer steps an epoch (128 samples, 4 ranks,
micro-batches of 4, gradient accumulation 2), 3 epochs, evaluation every 5 steps (gathered with
``gather_for_metrics``), AdamW with a LambdaLR schedule, clipping at 1.0. One torchrun run is the
reference of every test (module-scoped); one recovery runs in CI, the rest are ``slow``.
"""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="accelerate (pip install 'ftrun[hf]') is not installed")

import digits_job as dj  # noqa: E402
from once import shared_once  # noqa: E402
from framework_helpers import assert_recovered_in_place, events as _events, hf_env as _env  # noqa: E402
from reference_runs import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "accelerate_loop.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")
ARGS = ["--train_size", "128", "--epochs", "3", "--eval_every", "5", "--accum", "2"]
WORLD = 4

pytestmark = [pytest.mark.integration, pytest.mark.frameworks, pytest.mark.xdist_group("accelerate")]


def _assert_recovered_in_place(events: list[dict], faulted: int) -> None:
    assert_recovered_in_place(events, faulted, WORLD, allow_behind=True)


def _final(stdout: str) -> tuple[int, str, str]:
    """(steps, final evaluation loss, params digest) from rank 0's final line."""
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    return int(match.group(1)), match.group(2), match.group(4)


def _ftrun_cmd(tmp_path: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", str(WORLD), "--master_port", "0", "--plain",
            "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", "--max_restarts", "3",
            "--step_timeout", "120", str(SCRIPT), "--ftrun", *args]


#: What a rank's gloo teardown at interpreter exit prints when it aborts (SIGABRT), after the
#: loop's last collective and rank 0's final line (seen about once in seven torchrun runs of the
#: loop as written, on this 2-core machine under load).
TEARDOWN_ABORT = "terminate called without an active exception"


def _assert_torchrun_ok(proc: subprocess.CompletedProcess) -> None:
    """torchrun succeeded, or only a rank's exit aborted after the final line (:data:`TEARDOWN_ABORT`)."""
    teardown = FINAL.search(proc.stdout) and TEARDOWN_ABORT in proc.stderr and "Traceback" not in proc.stderr.split(
        TEARDOWN_ABORT)[0]
    assert proc.returncode == 0 or teardown, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str]:
    """The loop as written (``main``: accelerate's own DDP and DataLoader) under torchrun, 4 ranks."""
    def run() -> tuple[int, str, str]:
        cwd = tmp_path_factory.mktemp("accelerate_torchrun")
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT), *ARGS], env=_env(), cwd=cwd)
        _assert_torchrun_ok(proc)
        return _final(proc.stdout)

    return tuple(shared_once(tmp_path_factory, "accelerate_reference", run))


def _kill_when(tmp_path: Path, line: str, rank: int, args: list[str]) -> tuple[tuple[int, str, str], list[dict]]:
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(tmp_path, args), _env(), tmp_path, log_dir, line, rank)
    return _final(out), _events(log_dir)


def test_port_is_at_most_ten_lines() -> None:
    """``main_ftrun`` is ``main`` with at most ten lines changed or added, each marked ``# ftrun``."""
    tree = ast.parse(SCRIPT.read_text())
    source = SCRIPT.read_text().splitlines()
    bodies = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("main", "main_ftrun"):
            bodies[node.name] = source[node.body[0].lineno - 1:node.end_lineno]
    diff = [line for line in difflib.unified_diff(bodies["main"], bodies["main_ftrun"], lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line for line in diff if line.startswith("+")]
    assert 0 < len(added) <= 10, "\n".join(diff)
    assert all(line.rstrip().endswith(("# ftrun",)) or "# ftrun:" in line for line in added), "\n".join(added)


def test_accelerate_loop_sigkill_mid_epoch(tmp_path: Path, reference: tuple[int, str, str]) -> None:
    """Rank 2 SIGKILLed while rank 0 pauses after step 1 (of 4 in epoch 0): rank 2 dies in step
    2's gradient all-reduce (its second micro-batch), the survivors retry the step with its two
    micro-batches, the new rank resumes at its replicas' step and place in the pass, and the job
    ends with the reference's parameters and evaluation loss, bitwise."""
    final, events = _kill_when(tmp_path, "pause step_end step=1", rank=2, args=[*ARGS, "--pause_on", "step_end:1"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=2)


@pytest.mark.slow
def test_accelerate_loop_fault_free_matches_torchrun(tmp_path: Path, reference: tuple[int, str, str]) -> None:
    proc = subprocess.run(_ftrun_cmd(tmp_path, ARGS), env=_env(), capture_output=True, text=True, timeout=280,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    assert not [e for e in _events(tmp_path / "logs") if e["kind"] in ("rank_failed", "divergence")]


@pytest.mark.slow
def test_port_under_torchrun_is_the_loop(tmp_path: Path, reference: tuple[int, str, str]) -> None:
    """The port without ftrun (torchrun): ``FTAccelerator`` is ``Accelerator``, the run is the loop's."""
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT), "--ftrun", *ARGS],
                          env=_env(), capture_output=True, text=True, timeout=280, cwd=tmp_path)
    _assert_torchrun_ok(proc)
    assert _final(proc.stdout) == reference


@pytest.mark.slow
def test_accelerate_loop_sigkill_at_epoch_boundary(tmp_path: Path, reference: tuple[int, str, str]) -> None:
    """Rank 1 SIGKILLed while rank 0 pauses at the end of epoch 0 (after step 4): the others are in
    epoch 1's first step, whose pass starts with a draw of the synchronised sampler generator; the
    new rank starts epoch 1 with its replicas' generator and pass counter."""
    final, events = _kill_when(tmp_path, "pause epoch_end step=4", rank=1, args=[*ARGS, "--pause_on", "epoch_end:4"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=1)


@pytest.mark.slow
def test_accelerate_loop_sigkill_during_evaluation(tmp_path: Path, reference: tuple[int, str, str]) -> None:
    """Rank 3 SIGKILLed during the evaluation after step 5 (rank 0 pauses in its first evaluation
    batch; the others wait in ``gather_for_metrics``): the survivors' gather fails, they roll back
    to the evaluation's start and run it again with the new rank, which runs it before its first
    step."""
    final, events = _kill_when(tmp_path, "pause eval step=5", rank=3, args=[*ARGS, "--pause_on", "eval:5"])
    assert final == reference
    _assert_recovered_in_place(events, faulted=3)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [
    "rank=0,step=3,point=between_steps,kind=kill",   # rank 0 (the main process, the donor of choice) after step 3
    "rank=2,step=5,point=before_forward,kind=kill",  # after the evaluation that followed step 4
    "rank=1,step=4,point=allreduce,kind=kill",       # in the all-reduce of an epoch's first step
    "rank=3,step=4,point=section,kind=kill",         # at the start of the evaluation after step 4
])
def test_accelerate_loop_injected_faults(tmp_path: Path, reference: tuple[int, str, str], fault: str) -> None:
    """Faults at ftrun's injection points (docs/fault-injection.md), each bitwise equal."""
    proc = subprocess.run(_ftrun_cmd(tmp_path, ARGS), env={**_env(), "FTRUN_FAULT": fault}, capture_output=True,
                          text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    events = _events(tmp_path / "logs")
    assert [e for e in events if e["kind"] == "recovery_finished"]
    assert not [e for e in events if e["kind"] in ("divergence", "job_restarting")]

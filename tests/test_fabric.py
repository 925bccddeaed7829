"""Lightning Fabric loops under ftrun: examples/fabric_loop.py's port
(``main_ftrun``, ``ftrun.integrations.fabric``) on 4 ranks against the loop as written (``main``)
under torchrun, bitwise (the parameters' SHA-256, every evaluation's loss and accuracy), without and
with a rank SIGKILLed from outside: mid-epoch, at an epoch boundary and during an evaluation; the
survivors keep their processes.

The job: a small classifier on synthetic data, 4 optimizer steps an epoch (128 samples, 4 ranks,
micro-batches of 4, gradient accumulation 2 with ``no_backward_sync``), 3 epochs, an evaluation every
5 steps (``fabric.all_reduce`` and ``fabric.barrier``), AdamW with a LambdaLR schedule, clipping at
1.0. One torchrun run is the reference of every test (made once per test run); the mid-epoch
recovery and the port under plain torchrun (three runs, each rank must exit) run in CI, the rest
are ``slow``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the lightning extra (pip install 'ftrun[lightning]') is not installed")

import digits_job as dj  # noqa: E402
import framework_helpers as fh  # noqa: E402
from conftest import run_bounded  # noqa: E402
from once import shared_once  # noqa: E402
from reference_runs import run_torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fabric_loop.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")
ARGS = ["--train_size", "128", "--epochs", "3", "--eval_every", "5", "--accum", "2"]
WORLD = 4

pytestmark = [pytest.mark.integration, pytest.mark.frameworks, pytest.mark.xdist_group("fabric")]


def _final(stdout: str) -> tuple[str, ...]:
    """(steps, final evaluation loss, accuracy, params digest) from rank 0's final line, then each
    evaluation's line (once: an evaluation run again after a fault prints its line twice)."""
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    evaluations = list(dict.fromkeys(re.findall(r"step \d+ eval_loss \S+ accuracy \S+", stdout)))
    return (*match.groups(), *evaluations)


def _ftrun_cmd(tmp_path: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", str(WORLD), "--master_port", "0", "--plain",
            "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", "--max_restarts", "3",
            "--step_timeout", "120", str(SCRIPT), "--ftrun", *args]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """The loop as written (``main``: Fabric's own DDP strategy) under torchrun, 4 ranks."""
    def run() -> tuple[str, ...]:
        cwd = tmp_path_factory.mktemp("fabric_torchrun")
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT), *ARGS], env=fh.env(), cwd=cwd)
        fh.assert_torchrun_ok(proc, FINAL)
        final = _final(proc.stdout)
        assert final[0] == "12" and len(final) == 4 + 2, final  # 12 steps, evaluations after steps 5 and 10
        return final

    return tuple(shared_once(tmp_path_factory, "fabric_reference", run))


def _kill_when(tmp_path: Path, line: str, rank: int, args: list[str]) -> tuple[tuple[str, ...], list[dict]]:
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(tmp_path, args), fh.env(), tmp_path, log_dir, line, rank)
    return _final(out), fh.events(log_dir)


def test_port_is_at_most_ten_lines() -> None:
    """``main_ftrun`` is ``main`` with at most ten lines changed or added, each marked ``# ftrun``."""
    diff = fh.port_diff(SCRIPT)
    added = [line for line in diff if line.startswith("+")]
    assert 0 < len(added) <= 10, "\n".join(diff)
    assert all(line.rstrip().endswith("# ftrun") or "# ftrun:" in line for line in added), "\n".join(added)


def test_ftfabric_outside_ftrun_is_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process without ftrun: ``train_batches`` is the loader, ``recoverable`` the function,
    ``completed_steps`` the ``optimizer.step()`` calls; a bad ``accumulate`` is one ValueError."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ftrun.integrations.fabric import FTFabric

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    fabric = FTFabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(3, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2))
    run = lambda step: step  # noqa: E731
    assert fabric.recoverable(run) is run
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        fabric.train_batches(loader, 0)
    for i, (x,) in enumerate(fabric.train_batches(loader, 2)):
        fabric.backward(model(x).sum())
        if (i + 1) % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
    assert i == 3 and fabric.completed_steps == 2


def test_fabric_loop_sigkill_mid_epoch(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """Rank 2 SIGKILLed while rank 0 pauses after step 1 (of 4 in epoch 0): rank 2 dies in step
    2's gradient all-reduce (its second micro-batch); inside ``optimizer.step()`` the survivors
    recover, put back the first micro-batch's gradients and run the second's backward again with
    the new rank, which runs the step's two micro-batches from its replicas' place in the pass; the
    job ends with the reference's parameters and evaluations, bitwise."""
    final, events = _kill_when(tmp_path, "pause step_end step=1", rank=2, args=[*ARGS, "--pause_on", "step_end:1"])
    assert final == reference
    fh.assert_recovered_in_place(events, faulted=2, world=WORLD)
    retried = [rank for rank in (0, 1, 3) if "step 1's update failed" in (tmp_path / "logs" / f"worker_{rank}.log").read_text()]
    assert retried, "no survivor retried step 1 inside optimizer.step()"


@pytest.mark.slow
def test_fabric_loop_fault_free_matches_torchrun(tmp_path: Path, reference: tuple[str, ...]) -> None:
    proc = run_bounded(_ftrun_cmd(tmp_path, ARGS), env=fh.env(), cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    assert not [e for e in fh.events(tmp_path / "logs") if e["kind"] in ("rank_failed", "divergence")]


#: Runs of the port under torchrun in :func:`test_port_under_torchrun_is_the_loop_and_exits`.
TORCHRUN_RUNS = 3


def test_port_under_torchrun_is_the_loop_and_exits(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """The port without ftrun (torchrun), run :data:`TORCHRUN_RUNS` times: ``FTFabric`` is
    ``Fabric``, each run is the loop's, and every rank exits. One rank of such a run once never
    exited (its gloo group destructed, with the GIL held, as ``main_ftrun`` returned after
    ``ft.finish()``; ``ftrun.rank.group.TrainingGroup.drop``); a run that hangs times out here, killed
    whole. ``scripts/exit_loop.py`` runs it 50 times."""
    for run in range(TORCHRUN_RUNS):
        cwd = tmp_path / f"run{run}"
        cwd.mkdir()
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT), "--ftrun", *ARGS],
                            env=fh.env(), cwd=cwd, timeout=240)
        fh.assert_torchrun_ok(proc, FINAL)
        assert _final(proc.stdout) == reference, f"run {run + 1}"


@pytest.mark.slow
def test_fabric_loop_sigkill_at_epoch_boundary(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """Rank 1 SIGKILLed while rank 0 pauses at the end of epoch 0 (after step 4): the others are in
    epoch 1's first step, whose pass draws its order there (Fabric's pass counter, given to the
    sampler's ``set_epoch``); the new rank starts epoch 1 with its replicas' counter."""
    final, events = _kill_when(tmp_path, "pause epoch_end step=4", rank=1, args=[*ARGS, "--pause_on", "epoch_end:4"])
    assert final == reference
    fh.assert_recovered_in_place(events, faulted=1, world=WORLD)


@pytest.mark.slow
def test_fabric_loop_sigkill_during_evaluation(tmp_path: Path, reference: tuple[str, ...]) -> None:
    """Rank 3 SIGKILLed during the evaluation after step 5 (rank 0 pauses in its first evaluation
    batch; the others wait in ``fabric.all_reduce``): the survivors' all-reduce fails, they roll back
    to the evaluation's start and run it again with the new rank, which runs it before its first
    step."""
    final, events = _kill_when(tmp_path, "pause eval step=5", rank=3, args=[*ARGS, "--pause_on", "eval:5"])
    assert final == reference
    fh.assert_recovered_in_place(events, faulted=3, world=WORLD)

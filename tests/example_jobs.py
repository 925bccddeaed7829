"""What the tests of real training scripts read from a job: its final digest, its events, and
whether it recovered rank by rank; and the torchrun twins' digests they compare with."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from once import shared_once
from reference_runs import run_torchrun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MNIST_ARGS = ["--epochs", "2", "--log-interval", "4"]

# The last line of every example: the parameters' SHA-256 after the last step.
FINAL = re.compile(r"final step=(\d+) loss=\S+ test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")


def final_digest(stdout: str) -> str:
    """The ``params_sha256`` of the job's final line (fails the test without one)."""
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    return match.group(3)


def job_events(log_dir: Path) -> list[dict]:
    """The objects of LOG_DIR/events.jsonl, in order ([] before the file exists)."""
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def assert_recovered_in_place(events: list[dict], faulted: set[int]) -> None:
    """Only the ``faulted`` ranks were started again, the job never restarted as a whole, and a
    recovery finished."""
    pids: dict[int, list[int]] = {}
    for ev in events:
        if ev["kind"] == "rank_started":
            pids.setdefault(ev["rank"], []).append(ev["pid"])
    for rank, started in pids.items():
        if rank not in faulted:
            assert len(started) == 1, f"rank {rank} was restarted: {started}"
    assert not [e for e in events if e["kind"] == "job_restarting"], "fell back to a whole-job restart"
    assert [e for e in events if e["kind"] == "recovery_finished"], "no recovery finished"


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ftrun's, torchrun's and MindSpore's variables, plus ``extra``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    out.update(extra or {})
    return out


def torchrun_digest(cwd: Path, script: str, args: list[str]) -> str:
    """The parameters' digest of ``script`` under plain torchrun on 2 ranks (DDP, no ftrun)."""
    proc = run_torchrun(["--standalone", "--nproc_per_node", "2", str(EXAMPLES / script), *args], env=clean_env(), cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return final_digest(proc.stdout)


@pytest.fixture(scope="module")
def mnist_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """pytorch/examples' mnist's torchrun twin's parameters (plain DDP, no ftrun; computed once a run)."""
    return shared_once(tmp_path_factory, "mnist_reference", lambda: torchrun_digest(
        tmp_path_factory.mktemp("mnist_torchrun"), "mnist_torchrun.py", MNIST_ARGS))

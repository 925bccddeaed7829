"""What the tests of real training scripts read from a job: its final digest, its events, and
whether it recovered rank by rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

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

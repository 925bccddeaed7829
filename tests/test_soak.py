"""Soak: a long digits job under a stream of outside faults ends bitwise equal to the fault-free run.

300 steps on 4 ranks, each followed by a 280 ms pause while faults are sent (same result; the
fault-free reference and the job's steps after the last fault run without it); every few seconds, once the previous recovery has
finished, a random rank gets SIGKILL or SIGSTOP from outside (a seeded sequence, so a failure names a reproducible order of
faults; the timing is the machine's). At least 10 faults; no process may be left behind. The run's
figures (faults, recoveries, time lost) are printed for docs/benchmarks.md.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import uuid

import digits_job as dj
import pytest
from conftest import TAG_VAR, tagged, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = dj.SOAK_STEPS
FAULTS = 10


def _cmd(log_dir: Path, pause_file: Path) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain", "--log_dir", str(log_dir),
            "--tail_worker_log", "0", "--max_restarts", str(FAULTS + 5), str(dj.SCRIPT), "--steps", STEPS,
            "--log_every", "10", "--step_pause", dj.SOAK_PAUSE, "--pause_while", str(pause_file)]


def test_soak_random_kills_and_stops(tmp_path: Path, soak_reference: str) -> None:
    reference = soak_reference

    log_dir = tmp_path / "soak"
    pause_file = tmp_path / "stretch"  # the job pauses after each step while it exists (faults are being sent)
    pause_file.touch()
    tag = uuid.uuid4().hex  # inherited by every process of the job: what is left is found by it
    proc = subprocess.Popen(_cmd(log_dir, pause_file), env=dj.env({TAG_VAR: tag}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, start_new_session=True)
    rng = random.Random(2026)
    sent: list[tuple[int, str]] = []
    started = time.monotonic()
    try:
        dj.wait_for(lambda: dj.training(log_dir), timeout=180)
        while len(sent) < FAULTS and proc.poll() is None:
            events = dj.events(log_dir)
            finished = len([e for e in events if e["kind"] == "recovery_finished"])
            if finished < len(sent):  # the previous fault is still being recovered
                time.sleep(0.1)
                continue
            time.sleep(rng.uniform(1.0, 3.0))
            rank = rng.randrange(4)
            sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
            pid = dj.started(dj.events(log_dir))[rank][-1]
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            sent.append((rank, sig.name))
            dj.wait_for(lambda: len([e for e in dj.events(log_dir) if e["kind"] == "rank_failed"]) >= len(sent), timeout=60)
        pause_file.unlink()  # enough faults: the rest of the job runs at full speed
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - started
    assert proc.returncode == 0, out[-4000:]
    assert len(sent) >= FAULTS, f"the job ended after {len(sent)} faults; make it longer"
    assert dj.digest(out, STEPS) == reference
    events = dj.events(log_dir)
    recoveries = [e for e in events if e["kind"] == "recovery_finished"]
    assert len(recoveries) >= FAULTS and not [e for e in events if e["kind"] == "job_restarting"]
    lost = sum(e["detail"]["total_seconds"] for e in recoveries)
    print(f"\nsoak: {len(sent)} faults ({sum(s == 'SIGKILL' for _, s in sent)} SIGKILL, "
          f"{sum(s == 'SIGSTOP' for _, s in sent)} SIGSTOP), {len(recoveries)} recoveries, "
          f"{lost:.1f} s lost to faults, {wall:.1f} s wall, digest equal to the fault-free run")
    assert not wait_gone(tagged(tag), timeout=30), "processes left behind"

"""The 4-rank digits job as the ARF and watchdog tests run it, and how they read its results."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_digits.py"
STEPS = "24"
LONG_STEPS = "150"  # long enough that a test acts while the job still trains
SOAK_STEPS = "300"  # with SOAK_PAUSE, long enough for a stream of faults (about 95 s of training while they are sent)
SOAK_PAUSE = "0.28"  # seconds of sleep after each step while faults are sent: the soak trains long without a long reference run
FINAL = re.compile(r"final step=(\d+) loss=\S+ test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    out.update(extra or {})
    return out


def cmd(log_dir: Path, steps: str = STEPS, script: Path = SCRIPT) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain",
            "--log_dir", str(log_dir), "--tail_worker_log", "0", "--max_restarts", "4",
            str(script), "--steps", steps, "--log_every", "10"]


def events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def digest(stdout: str, steps: str = STEPS) -> str:
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-3000:]}"
    assert match.group(1) == steps
    return match.group(3)


def run(tmp_path: Path, fault: str | None = None, steps: str = STEPS, extra: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None, script: Path = SCRIPT) -> tuple[str, list[dict], str]:
    """Run the job to its end; returns (params_sha256, events, stdout). Asserts exit code 0."""
    log_dir = tmp_path / "logs"
    environ = env({**({"FTRUN_FAULT": fault} if fault else {}), **(extra_env or {})})
    proc = subprocess.run([*cmd(log_dir, steps, script), *extra], env=environ, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    return digest(proc.stdout, steps), events(log_dir), proc.stdout


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    """Wait for a job started with ``Popen`` (in its own session, output piped) to end and return
    its output; asserts exit code 0. A job still running when the wait fails is killed, its whole
    process group."""
    import signal

    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return out


def started(evs: list[dict]) -> dict[int, list[int]]:
    """rank -> PIDs of its processes, in order."""
    pids: dict[int, list[int]] = {}
    for ev in evs:
        if ev["kind"] == "rank_started":
            pids.setdefault(ev["rank"], []).append(ev["pid"])
    return pids


def story(evs: list[dict]) -> str:
    """The job's events without the routine ones, a line each (for an assertion's message)."""
    quiet = {"rank_started", "rank_joined", "rank_heartbeat", "rank_exited", "progress"}
    t0 = evs[0]["time"] if evs else 0.0
    lines = []
    for e in evs:
        if e["kind"] not in quiet:
            lines.append(f"{e['time'] - t0:8.2f} {e['kind']}: {e['message'][:300]}")
            # A hung rank's stacks: all a CI log keeps of why it did not move.
            lines.extend(f"           | {line}" for line in e.get("stacks", [])[-40:])
            # A rank that exited with an error: the end of its log (its traceback).
            lines.extend(f"           | {line}" for line in e.get("detail", {}).get("log_tail", []))
    return "\n".join(lines)


def assert_survivors_kept_pids(evs: list[dict], faulted: set[int]) -> None:
    pids = started(evs)
    for rank in range(4):
        if rank not in faulted:
            assert len(pids[rank]) == 1, f"rank {rank} was restarted: {pids[rank]}\n{story(evs)}"
    assert not [e for e in evs if e["kind"] == "job_restarting"], "ARF fell back to a whole-job restart"
    assert [e for e in evs if e["kind"] == "recovery_finished"], "no recovery finished"


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def start(tmp_path: Path, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start the long job in the background (its own session, so a test can kill it all)."""
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(cmd(log_dir, LONG_STEPS), env=env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, start_new_session=True)
    return proc, log_dir


def training(log_dir: Path) -> bool:
    """Every rank has connected and rank 0 has printed step 20 (so steps are being committed)."""
    joined = len({e["rank"] for e in events(log_dir) if e["kind"] == "rank_joined"}) == 4
    log = log_dir / "worker_0.log"
    return joined and log.exists() and "step 20 loss" in log.read_text()


def signal_rank_and_finish(tmp_path: Path, rank: int, sig: int) -> tuple[str, Path]:
    """Start the long job, send ``sig`` to ``rank``'s first process once it trains, and let the job
    run to its end; returns (its output, its log dir). Asserts exit code 0; kills everything left
    on the way out."""
    import signal

    proc, log_dir = start(tmp_path)
    try:
        wait_for(lambda: training(log_dir))
        os.kill(started(events(log_dir))[rank][0], sig)
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    return out, log_dir


def kill_rank_when_logged(cmd: list[str], env: dict[str, str], cwd: Path, log_dir: Path, line: str, rank: int,
                          timeout: float = 240) -> str:
    """Run a launcher (``cmd``), SIGKILL ``rank``'s first process from outside once rank 0's log
    shows ``line``, and let the job end; returns its output. Asserts exit code 0; nothing is left
    running on failure."""
    import signal

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            start_new_session=True)
    try:
        log = log_dir / "worker_0.log"
        deadline = time.monotonic() + timeout
        while not (log.exists() and line in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, f"{line!r} never printed"
            time.sleep(0.05)
        pid = next(e["pid"] for e in events(log_dir) if e["kind"] == "rank_started" and e["rank"] == rank)
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return out

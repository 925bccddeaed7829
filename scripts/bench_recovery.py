"""Time to recover from a SIGKILL: ftrun (ARF) against torchrun (whole-job restart + checkpoint).

    python scripts/bench_recovery.py [--ranks 4] [--kill_step 60] [--ckpt_every 25] [--repeats 1]

The same digits job runs under both launchers; when rank 0 prints step ``kill_step``, this script
SIGKILLs rank ``victim`` from outside (no help from any library). It then reads the step lines
(``step N loss L time T``, printed every step by rank 0 with its own clock) and reports, per launcher:

- failed_step: the first step the job could not finish because of the kill (the victim may die
  after its share of the step in progress, which then still finishes);
- recover_s: time from the kill to rank 0 finishing the failed step (the job's step counter
  passing the failed step again);
- recomputed: steps executed twice (torchrun resumes from its last checkpoint; ftrun from the first
  uncommitted step);
- total_s: wall time of the whole job.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its default shared store fails to
restart a gloo job after a SIGKILL in torch 2.13: pytorch issues 135712, 167288) and
``--max-restarts 1``; its script checkpoints every ``ckpt_every`` steps and resumes from it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step (\d+) loss \S+ time (\d+\.\d+)")


def find_rank_pid(launcher_pid: int, rank: int, script: str) -> int | None:
    """PID of the process serving ``rank`` below the launcher (read from its environment)."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if script in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def run_case(kind: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    script = "train_digits.py" if kind == "ftrun" else "train_digits_torchrun.py"
    common = [str(ROOT / "examples" / script), "--steps", str(args.steps), "--log_every", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    if kind == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(args.ranks), "--master_port", "0", "--plain",
               "--tail_worker_log", "0", "--log_dir", str(workdir / "logs"), "--max_restarts", "1", *common]
    else:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
               "--max-restarts", "1", "--standalone",
               *common, "--ckpt_dir", str(workdir / "ckpt"), "--ckpt_every", str(args.ckpt_every)]
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[int, float]] = []
    tail: list[str] = []
    kill: dict[str, float] = {}

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            match = STEP.search(line)
            if not match:
                continue
            step, stamp = int(match.group(1)), float(match.group(2))
            lines.append((step, stamp))
            if step == args.kill_step and "time" not in kill:
                pid = find_rank_pid(proc.pid, args.victim, script)
                if pid is not None:
                    kill["time"] = time.time()
                    kill["step"] = step
                    os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    proc.wait(timeout=900)
    thread.join(timeout=10)
    total = time.time() - started
    if proc.returncode != 0 or "time" not in kill:
        raise RuntimeError(f"{kind}: exit {proc.returncode}, kill {'done' if kill else 'not done'}:\n" + "\n".join(tail[-200:]))
    # Step lines reach us late (through a log and the launcher), so decide from their own clocks.
    # The victim may die after its part of the current step, so that step still finishes; the fault
    # shows as the longest pause between step lines after the kill. The failed step is the first
    # one not finished before that pause.
    seq = [(max((s for s, t in lines if t <= kill["time"]), default=-1), kill["time"])]
    seq += [(s, t) for s, t in lines if t > kill["time"]]
    gap = max(range(len(seq) - 1), key=lambda i: seq[i + 1][1] - seq[i][1])
    failed_step = seq[gap][0] + 1
    passed = next(t for s, t in seq[gap + 1 :] if s >= failed_step)
    return {
        "failed_step": failed_step,
        "recover_s": passed - kill["time"],
        "recomputed": max(0, failed_step - seq[gap + 1][0]),
        "total_s": total,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill_step", type=int, default=60)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--ckpt_every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"ftrun": [], "torchrun": []}
    for _ in range(args.repeats):
        for kind in ("ftrun", "torchrun"):
            workdir = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
            try:
                results[kind].append(run_case(kind, args, workdir))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    print(f"digits job, {args.ranks} ranks, SIGKILL of rank {args.victim} at step {args.kill_step}, "
          f"torchrun checkpoint every {args.ckpt_every} steps, {args.repeats} repeat(s)")
    print(f"{'launcher':<10} {'failed_step':>11} {'recover_s':>10} {'spread_s':>9} {'recomputed':>11} {'total_s':>8}")
    for kind, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        spread = max(r["recover_s"] for r in rows) - min(r["recover_s"] for r in rows)
        print(f"{kind:<10} {med['failed_step']:>11.0f} {med['recover_s']:>10.2f} {spread:>9.2f} "
              f"{med['recomputed']:>11.0f} {med['total_s']:>8.1f}")
    ratios = [t["recover_s"] / f["recover_s"] for f, t in zip(results["ftrun"], results["torchrun"])]
    print(f"torchrun/ftrun recovery time ratio (pairwise median): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()

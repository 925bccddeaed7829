"""Step-time cost of ftrun's metrics: the digits job with --metrics_port off and on (scraped at a
given rate), interleaved, plus the CPU time of one progress sample and one scrape in the supervisor.

    .venv/bin/python scripts/bench_metrics.py --ranks 2 --steps 600 --repeats 3 --scrape-hz 1 20

A run's step time is rank 0's mean over steps 100..N (its ``step S loss L time T`` lines), so start-up
and warm-up are left out. Modes run in turn within each repeat, so a machine's load drifts over all of
them alike; the ratio is taken pair by pair (same repeat) and its median printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step (\d+) loss \S+ time (\d+\.\d+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(ranks: int, steps: int, scrape_hz: float | None) -> tuple[float, int]:
    """Run the job once; return (seconds per step over steps 100..steps-1, scrapes made)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(ranks), "--master_port", "0", "--plain",
               "--log_dir", f"{tmp}/logs", "--checkpoint_dir", f"{tmp}/ckpt", "--tail_worker_log", "0",
               str(ROOT / "examples" / "train_digits.py"), "--steps", str(steps), "--log_every", "50"]
        port = None
        if scrape_hz:
            port = free_port()
            cmd[3:3] = ["--metrics_port", str(port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
        stop = threading.Event()
        scrapes = [0]

        def scraper() -> None:
            while not stop.wait(1.0 / scrape_hz):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                    scrapes[0] += 1
                except OSError:
                    pass

        thread = threading.Thread(target=scraper, daemon=True) if scrape_hz else None
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        if thread:
            thread.start()
        out, _ = proc.communicate(timeout=1800)
        stop.set()
        if proc.returncode != 0:
            raise RuntimeError(f"job failed ({proc.returncode}):\n{out[-3000:]}")
        marks = {int(m.group(1)): float(m.group(2)) for m in STEP.finditer(out)}
        first, last = 100, max(marks)
        return (marks[last] - marks[first]) / (last - first), scrapes[0]


def micro(ranks: int, repeats: int = 2000) -> tuple[float, float]:
    """CPU seconds of one progress sample and one /metrics render, for a status of ``ranks`` rows."""
    from ftrun.coordinator.metrics import JobMetrics
    from ftrun.tools.report import ProgressRecorder

    with tempfile.TemporaryDirectory() as tmp:
        rows = [{"rank": r, "local_rank": r, "node": 0, "pid": 1000 + r, "state": "healthy", "step": 100 + (r % 2),
                 "total_steps": 1000, "last_step_seconds": 0.02, "metrics": {"loss": 0.1}, "restarts": 0,
                 "incarnation": 0, "uptime": 10.0, "exit": None} for r in range(ranks)]
        status = {"ranks": rows, "attempt": 0, "state": "running", "pid": os.getpid(), "updated": time.time()}
        (Path(tmp) / "status.json").write_text(json.dumps(status))
        recorder = ProgressRecorder(Path(tmp))
        t0 = time.process_time()
        for _ in range(repeats):
            recorder._last = None  # as if a step moved: every sample is read, parsed and written
            recorder.sample()
        sample_s = (time.process_time() - t0) / repeats
        recorder.close()
        metrics = JobMetrics(Path(tmp), status_source=lambda: status)
        metrics.observe({"time": time.time(), "kind": "job_started", "message": "", "detail": {}})
        t0 = time.process_time()
        for _ in range(repeats // 10):
            metrics.render()
        render_s = (time.process_time() - t0) / (repeats // 10)
    return sample_s, render_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scrape-hz", type=float, nargs="+", default=[1.0])
    args = parser.parse_args()
    for ranks in (2, 64, 1024):
        sample_s, render_s = micro(ranks)
        print(f"supervisor CPU, {ranks} ranks: progress sample {sample_s * 1e6:.0f} us, /metrics scrape {render_s * 1e3:.2f} ms",
              flush=True)
    modes: list[float | None] = [None, *args.scrape_hz]
    results: dict[float | None, list[float]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            step_s, scrapes = run_job(args.ranks, args.steps, mode)
            results[mode].append(step_s)
            name = "metrics off" if mode is None else f"metrics on, {mode:g} scrape/s"
            print(f"repeat {repeat}: {name:<24} {step_s * 1000:7.2f} ms/step ({scrapes} scrapes)", flush=True)
    print(f"\ndigits job, {args.ranks} ranks, {args.steps} steps, step time over steps 100..{args.steps - 1}, "
          f"{args.repeats} repeat(s)")
    print(f"{'mode':<26} {'median ms/step':>15} {'vs off (pairwise median)':>26}")
    for mode in modes:
        name = "metrics off" if mode is None else f"metrics on, {mode:g} scrape/s"
        ratio = statistics.median(a / b for a, b in zip(results[mode], results[None]))
        print(f"{name:<26} {statistics.median(results[mode]) * 1000:15.2f} {(ratio - 1) * 100:+25.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the Fabric port under plain torchrun again and again, a few at a time, and count the runs
that do not exit: a rank of the worker library must never keep its process from ending.

    python scripts/exit_loop.py                      # 50 runs, two at a time
    python scripts/exit_loop.py --runs 10 --parallel 3 --timeout 300

Each run is ``torchrun --standalone --nproc_per_node 4 examples/fabric_loop.py --ftrun
--train_size 128 --epochs 3 --eval_every 5 --accum 2`` (tests/test_fabric.py's reference command,
the port without ftrun) in its own directory under ``--work_dir``. A run still going after
``--timeout`` seconds counts as a hang: the Python stacks of every thread of its ranks still alive
(``py-spy dump --native`` when py-spy is installed) go to ``hang_<n>.txt``, then the run is killed
whole (torchrun, its session and every rank, each of which torchrun starts in a session of its
own). Prints one line per run, then ``runs=<n> ok=<n> hangs=<n> failed=<n>``; exits 1 if any run
hung or failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fabric_loop.py"
ARGS = ["--ftrun", "--train_size", "128", "--epochs", "3", "--eval_every", "5", "--accum", "2"]
TAG_VAR = "EXIT_LOOP_TAG"


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``TAG_VAR=tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def stacks(procs: list[psutil.Process]) -> str:
    """Every thread's stack of each process (py-spy, native frames included), or why not."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = []
    for proc in procs:
        try:
            head = f"== pid {proc.pid} (parent {proc.ppid()}, {proc.num_threads()} threads): {' '.join(proc.cmdline())}"
        except psutil.Error:
            continue
        if not Path(spy).exists():
            out.append(f"{head}\n(py-spy not installed: pip install py-spy)")
            continue
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=120)
        out.append(f"{head}\n{dump.stdout}{dump.stderr}")
    return "\n".join(out)


def one_run(n: int, work_dir: Path, timeout: float) -> tuple[int, str, float]:
    """Run ``n``: (n, "ok" | "hang" | "failed <code>", seconds)."""
    cwd = work_dir / f"run{n}"
    cwd.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", TAG_VAR: tag})
    torchrun = Path(sys.executable).with_name("torchrun")
    started = time.monotonic()
    with open(cwd / "stdout.txt", "wb") as out, open(cwd / "stderr.txt", "wb") as err:
        popen = subprocess.Popen([str(torchrun), "--standalone", "--nproc_per_node", "4", str(SCRIPT), *ARGS],
                                 cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True)
        try:
            code = popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            alive = [p for p in tagged(tag) if p.pid != popen.pid]
            (work_dir / f"hang_{n}.txt").write_text(stacks(alive))
            for proc in [*tagged(tag)]:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            popen.wait()
            return n, "hang", time.monotonic() - started
    seconds = time.monotonic() - started
    final = "final step=12" in (cwd / "stdout.txt").read_text(errors="replace")
    return n, "ok" if code == 0 and final else f"failed {code}", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (load on the machine)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds after which a run counts as hung")
    parser.add_argument("--work_dir", type=Path, default=None, help="default: a new temporary directory")
    args = parser.parse_args()
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="exit_loop_"))
    print(f"{args.runs} runs, {args.parallel} at a time, timeout {args.timeout:.0f} s, in {work_dir}", flush=True)
    results = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for n, outcome, seconds in pool.map(lambda n: one_run(n, work_dir, args.timeout), range(args.runs)):
            results.append(outcome)
            print(f"run {n + 1:3d}: {outcome} in {seconds:.0f} s", flush=True)
    hangs, ok = results.count("hang"), results.count("ok")
    print(f"runs={len(results)} ok={ok} hangs={hangs} failed={len(results) - ok - hangs}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

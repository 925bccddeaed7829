"""Time to recover from a hung rank with ftrun's default settings: SIGSTOP from outside, or a hang
inside a step injected with ``FTRUN_FAULT`` (an endless loop, a deadlock on a Python lock).

    python scripts/bench_hang.py [--ranks 4] [--hang_step 60] [--repeats 3] [--kinds stop,hang,deadlock] [--hot]

The 4-rank digits job (``examples/train_digits.py``) runs under ftrun with its defaults
(``--heartbeat_timeout 5``, automatic step timeout: 10 x the largest step after warm-up, at least
3 s). When rank 0 prints step ``--hang_step``, rank ``--victim`` is frozen with SIGSTOP (``stop``),
or the victim hangs by itself at that step (``hang``, ``deadlock``). Measured, from the ranks' own
clocks: ``recover_s`` = the hang's start to rank 0 finishing the step that hung, split from ftrun's
events into detection (the watchdog noticing, stack dump included) and the rest (respawn, rebuild,
transfer, the retried step). Target of the hang issue: under 10 s. (torchrun has no watchdog: its
ranks would sit in the collective until the process group's timeout, 30 minutes by default.)

``--hot``: with ``--hot_spares 1``; the hang starts at the first step from ``--hang_step`` on at which
the hot spare waits at the training loop (the injected hangs through ``FTRUN_FAULT``'s ``when=``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import FINAL, STEP, Case, command, find_rank_pid, hot_ready  # noqa: E402


def run_once(kind: str, args: argparse.Namespace) -> dict[str, float]:
    """One job with one hang; returns recover_s, detection_s, the failed step."""
    case = Case("digits", "-", args.ranks, args.steps, args.hang_step, victim=args.victim, hot=args.hot)
    workdir = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    try:
        cmd, env, script = command("ftrun", case, workdir)
        cmd[cmd.index("--max_restarts") + 1] = "3"
        if kind != "stop":
            # Both hang once step hang_step is committed: the deadlock right after it, the loop
            # at the start of the next step.
            where = f"step={args.hang_step},point=between_steps" if kind == "deadlock" else f"step={args.hang_step + 1},point=before_forward"
            if args.hot:  # at the first step at which the hot spare is ready
                where = f"point={'between_steps' if kind == 'deadlock' else 'before_forward'},when={workdir / 'go'}"
            env["FTRUN_FAULT"] = f"rank={args.victim},{where},kind={kind}"
        proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        lines: list[tuple[int, float]] = []
        tail: list[str] = []
        stopped: dict[str, float] = {}

        def reader() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip())
                match = STEP.search(line)
                if not match:
                    continue
                step, stamp = int(match.group(1)), float(match.group(2))
                lines.append((step, stamp))
                if step < args.hang_step or "time" in stopped or (args.hot and not hot_ready(workdir)):
                    continue
                if kind == "stop":
                    pid = find_rank_pid(proc.pid, args.victim, script)
                    if pid is not None:
                        stopped["time"] = time.time()
                        os.kill(pid, signal.SIGSTOP)
                elif args.hot:
                    stopped["time"] = time.time()
                    (workdir / "go").touch()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        proc.wait(timeout=600)
        thread.join(timeout=10)
        if proc.returncode != 0 or not FINAL.search("\n".join(tail)):
            raise RuntimeError(f"{kind}: exit {proc.returncode}\n" + "\n".join(tail[-40:]))
        events = [json.loads(x) for x in (workdir / "logs" / "events.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # The hang starts after rank 0's line for hang_step (SIGSTOP: when we sent it, which can be a few
    # steps later, as lines reach us late); it is over at the end of the longest pause in rank 0's
    # step lines after that.
    start = stopped.get("time") or next(t for s, t in lines if s == args.hang_step)
    pauses = [(t1 - max(t0, start), t1) for (_, t0), (_, t1) in zip(lines, lines[1:]) if t1 > start]
    resumed = max(pauses)[1]
    hung = next(e for e in events if e["kind"] == "rank_hung")
    finished = next(e for e in events if e["kind"] == "recovery_finished")["detail"]
    return {
        "recover_s": resumed - start,
        "detection_s": hung["time"] - start,
        "respawn_s": max(float(v) for v in finished["respawn_seconds"].values()),
        "fault": hung["detail"]["fault"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--hang_step", type=int, default=60)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="stop,hang,deadlock")
    parser.add_argument("--hot", action="store_true", help="with a hot spare (--hot_spares 1)")
    args = parser.parse_args()
    if args.hot and args.steps == parser.get_default("steps"):
        args.steps = 3000  # long enough for the spare to be past the script's set-up
    print(f"digits job, {args.ranks} ranks, rank {args.victim} hangs after step {args.hang_step}, ftrun defaults"
          f"{' and a hot spare' if args.hot else ''}, {args.repeats} repeat(s)")
    print(f"{'hang':<9} {'detected by':<13} {'recover_s':>9} {'spread_s':>9} {'detect_s':>9} {'respawn_s':>9}")
    for kind in args.kinds.split(","):
        runs = [run_once(kind, args) for _ in range(args.repeats)]
        rec = [r["recover_s"] for r in runs]
        print(f"{kind:<9} {runs[0]['fault']:<13} {statistics.median(rec):>9.2f} {max(rec) - min(rec):>9.2f} "
              f"{statistics.median(r['detection_s'] for r in runs):>9.2f} "
              f"{statistics.median(r['respawn_s'] for r in runs):>9.2f}")


if __name__ == "__main__":
    main()

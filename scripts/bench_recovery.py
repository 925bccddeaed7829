"""Time to recover from a SIGKILL: ftrun (ARF) against torchrun (whole-job restart + checkpoint).

    python scripts/bench_recovery.py [--ranks 4] [--kill_step 60] [--ckpt_every 25] [--repeats 1]

The digits job alone, on one world size: a short form of ``scripts/bench.py --parts recovery``,
which it shares its runner with (see that script for how the kill is delivered and what each column
means). Per launcher it reports the failed step, recover_s (kill to rank 0 finishing the failed
step), recomputed steps and total wall time; the ratio is taken pair by pair.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its default shared store fails to
restart a gloo job after a SIGKILL in torch 2.13: pytorch issues 135712, 167288) and
``--max-restarts 1``; its script checkpoints every ``ckpt_every`` steps and resumes from it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import LAUNCHERS, Case, Run, run_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill_step", type=int, default=60)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--ckpt_every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    case = Case("digits", "-", args.ranks, args.steps, args.kill_step, victim=args.victim, ckpt_every=args.ckpt_every)
    results: dict[str, list[Run]] = {launcher: [] for launcher in LAUNCHERS}
    for _ in range(args.repeats):
        for launcher in LAUNCHERS:
            results[launcher].append(run_job(launcher, case))
    print(f"digits job, {args.ranks} ranks, SIGKILL of rank {args.victim} at step {args.kill_step}, "
          f"torchrun checkpoint every {args.ckpt_every} steps, {args.repeats} repeat(s)")
    print(f"{'launcher':<10} {'failed_step':>11} {'recover_s':>10} {'spread_s':>9} {'recomputed':>11} {'total_s':>8}")
    for launcher, runs in results.items():
        recover = [r.recover_s or 0.0 for r in runs]
        print(f"{launcher:<10} {statistics.median(r.failed_step or 0 for r in runs):>11.0f} "
              f"{statistics.median(recover):>10.2f} {max(recover) - min(recover):>9.2f} "
              f"{statistics.median(r.recomputed or 0 for r in runs):>11.0f} "
              f"{statistics.median(r.total_s for r in runs):>8.1f}")
    ratios = [(t.recover_s or 0.0) / (f.recover_s or 1.0) for f, t in zip(results["ftrun"], results["torchrun"])]
    print(f"torchrun/ftrun recovery time ratio (pairwise median): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()

"""What one part of ftrun's per-step bookkeeping costs a fault-free step, measured inside one run:
examples/word_lm.py under ftrun, with the part switched off on a pseudo-random half of
the blocks of ``--phase`` steps (the same on every rank; random, so that nothing periodic in the
run lines up with them); the median step time (wall clock, and CPU of rank
0's training thread) with the part on against off, after the first epoch.

Runs minutes apart on this kind of machine differ by 10 to 30% (torchrun's own small steps:
12 ms in one run, 15 ms in the next), more than any one part costs. Within one run the two halves
share the machine's pace: ``none`` (nothing switched off) measures what is left of the noise.

    .venv/bin/python scripts/ablate_steps.py --parts none,start,provisional --epochs 20 --phase 10

Parts (each is a measurement only: a run with a part off keeps no exactly-once guarantee):

- ``start``: the step start's copy and record (``ExactlyOnceChecks.snapshot_step_start``);
- ``provisional``: the provisional record when the backward starts (``record_provisional``);
- ``gradient``: the write of the local gradient's fingerprint after the last bucket (``record_gradient``);
- ``store``: every write of the rank's records to the job's store (``RankStateStore._set``);
- ``late``: the provisional record made where it was before (right before the step's last bucket
  leaves, carrying the fingerprint) instead of both writes above; its "saving" is then what the
  present placement costs more (negative: it costs less);
- ``fingerprint``: the local gradient's fingerprint (``Fingerprint.update``);
- ``none``: nothing (the A/A control).

The switch is a ``sitecustomize`` module put first on the ranks' ``PYTHONPATH``: it wraps those
functions, reading the rank's current step. Figures in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("none", "start", "provisional", "gradient", "store", "late", "fingerprint")
LARGE = ["--emsize", "128", "--nhid", "128", "--bptt", "35", "--batch_size", "8"]

# Runs in every rank (Python imports sitecustomize at start-up). ABLATE_PART is off on half of the blocks.
SITECUSTOMIZE = r'''
import builtins, os, sys
PART, PHASE = os.environ.get("ABLATE_PART", "none"), int(os.environ.get("ABLATE_PHASE", "10"))
_step = [0]
import random as _random
_BITS = _random.Random(BLOCKS_SEED).randbytes(1 << 16)  # a private generator: the script's streams untouched
def _off():  # the same pseudo-random half of the blocks of PHASE steps as phase_medians (no aliasing with a period)
    block = (_step[0] // PHASE) % (1 << 19)
    return (_BITS[block >> 3] >> (block & 7)) & 1 == 1
def _patch_exactlyonce(mod):
    E = mod.ExactlyOnceChecks
    start, provisional, gradient = E.snapshot_step_start, E.record_provisional, E.record_gradient
    def snapshot_step_start(self, mid_pass=False):
        _step[0] = self.progress.committed + 1
        if PART == "start" and _off():
            return None
        return start(self, mid_pass)
    def record_provisional(self):
        if PART in ("provisional", "late") and _off():
            return None
        return provisional(self)
    def record_gradient(self):
        if PART in ("gradient", "late") and _off():
            return None
        return gradient(self)
    E.snapshot_step_start, E.record_provisional, E.record_gradient = snapshot_step_start, record_provisional, record_gradient
def _patch_reducer(mod):
    G = mod.GradientReducer
    check = G._check_local_gradient
    def _check_local_gradient(self):  # right before the last bucket leaves
        check(self)
        if PART == "late" and _off():
            checks = self._at_pass_start.__self__
            step = checks.progress.current_step
            if step is not None and checks.progress.committed == step - 1 and checks.keeps_rank_records():
                checks.rank_states.put(step, checks.registry.state_dict(only=("rank",)), provisional=True,
                                       gradient=checks._gradient_of(step))
    G._check_local_gradient = _check_local_gradient
def _patch_rankstate(mod):
    S = mod.RankStateStore
    put = S._set
    def _set(self, key, value):
        if PART == "store" and _off():
            return None
        return put(self, key, value)
    S._set = _set
def _patch_digest(mod):
    F = mod.Fingerprint
    update = F.update
    def _update(self, t):
        if PART == "fingerprint" and _off():
            return None
        return update(self, t)
    F.update = _update
_PATCHES = {"ftrun.rank.exactlyonce": ("ExactlyOnceChecks", _patch_exactlyonce), "ftrun.rank.reducer": ("GradientReducer", _patch_reducer),
            "ftrun.rank.rankstate": ("RankStateStore", _patch_rankstate), "ftrun.rank.digest": ("Fingerprint", _patch_digest)}
_import = builtins.__import__
def _hooked(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    for key, (attr, patch) in list(_PATCHES.items()):
        mod = sys.modules.get(key)
        if mod is not None and hasattr(mod, attr):
            del _PATCHES[key]
            patch(mod)
    if not _PATCHES:
        builtins.__import__ = _import
    return module
builtins.__import__ = _hooked  # every part, "none" too: the same wrappers on both sides
'''

BLOCKS_SEED = 20261127
BITS = random.Random(BLOCKS_SEED).randbytes(1 << 16)
SITECUSTOMIZE = SITECUSTOMIZE.replace("BLOCKS_SEED", str(BLOCKS_SEED))
STEP_LINE = re.compile(r"^step (\d+) loss \S+ time (\S+) cpu (\S+)", re.M)


def phase_medians(log: str, phase: int, skip: int) -> tuple[float, float, float, float, int]:
    """(wall on, wall off, CPU on, CPU off) medians in ms of the steps after ``skip``, and the
    number of steps on each side. A gap spanning an epoch's end (an evaluation) is left out."""
    points = [(int(s), float(t), float(c)) for s, t, c in STEP_LINE.findall(log)]
    gaps: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for (s0, t0, c0), (s1, t1, c1) in zip(points, points[1:]):
        if s1 != s0 + 1 or s1 < skip:
            continue
        block = (s1 // phase) % (1 << 19)
        gaps[(BITS[block >> 3] >> (block & 7)) & 1 == 0].append((t1 - t0, c1 - c0))  # as the ranks' _off()
    cutoff = {side: 3 * statistics.median(g[0] for g in gaps[side]) for side in gaps}  # evaluations, epoch ends
    med = {side: [statistics.median(x[i] for x in gaps[side] if x[0] < cutoff[side]) * 1000 for i in (0, 1)] for side in gaps}
    return med[True][0], med[False][0], med[True][1], med[False][1], min(len(gaps[True]), len(gaps[False]))


def run(part: str, args: argparse.Namespace, workdir: Path) -> str:
    """One ftrun run of word_lm with ``part`` switched off on half of the blocks; rank 0's log."""
    site = workdir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ABLATE_PART=part, ABLATE_PHASE=str(args.phase),
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    logs = Path(tempfile.mkdtemp(prefix=f"logs-{part}-", dir=workdir))
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(args.ranks), "--master_port", "0", "--plain",
           "--tail_worker_log", "0", "--log_dir", str(logs), str(ROOT / "examples" / "word_lm.py"),
           "--epochs", str(args.epochs), "--step-times", "--train-lines", "3000", *(LARGE if args.size == "large" else [])]
    done = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"ablate_steps: the run with {part} switched off on half of its steps failed (exit {done.returncode}): {done.stderr[-400:]}")
    return (logs / "worker_0.log").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="none,start,provisional", help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--epochs", type=int, default=20, help="word_lm's epochs (126 small steps each)")
    parser.add_argument("--phase", type=int, default=10, help="steps a block (each block on or off, at random)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each part, in turn")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or args.phase < 1 or args.epochs < 2:
        sys.exit(f"ablate_steps: unknown part {unknown[0]!r} (choose from {', '.join(PARTS)})" if unknown
                 else "ablate_steps: --phase must be at least 1 and --epochs at least 2")
    print(f"{'part':<12} {'wall on':>8} {'wall off':>8} {'saving':>7} {'cpu on':>7} {'cpu off':>7} {'steps':>6}")
    with tempfile.TemporaryDirectory(prefix="ftrun-ablate-") as tmp:
        for _ in range(args.rounds):
            for part in parts:
                log = run(part, args, Path(tmp))
                skip = int(STEP_LINE.findall(log)[-1][0]) // args.epochs + 1 if STEP_LINE.search(log) else 0  # after epoch 1
                on, off, cpu_on, cpu_off, n = phase_medians(log, args.phase, skip)
                print(f"{part:<12} {on:8.2f} {off:8.2f} {100 * (on - off) / off:+6.1f}% {cpu_on:7.2f} {cpu_off:7.2f} {n:6d}", flush=True)


if __name__ == "__main__":
    main()

"""Recovery at 8 to 64 ranks, and on a GPU: ftrun (warm spares, hot spares) against torchrun.

What the 2-core development machine cannot measure, sized for the lent machine (16 cores, one GPU,
one command of at most 9 minutes):

    python scripts/bench_big.py --out DIR                    # worlds 8,16,32,64 on the CPU, then the GPU part
    python scripts/bench_big.py --worlds 2,4 --out DIR       # the dry run on a small machine
    python scripts/bench_big.py --from_json DIR/bench_big.json --out DIR   # report and plot again, run nothing

On the lent machine, through the device tool (pyzmq is not installed there and nothing can be
fetched: ``bash scripts/device_wheels.sh`` here puts its wheel in ``device_wheels/``, which travels
as a carried path; ftrun itself is imported from the tree, which this script puts on the ranks'
``PYTHONPATH``):

    run(command="set -o pipefail; python3 -m pip install -q --no-index --no-deps --target /tmp/site"
                " device_wheels/pyzmq-*.whl && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1"
                " python3 scripts/bench_big.py --out $OUT 2>&1 | tee $OUT/bench_big.log",
        carry=["device_wheels"], timeout_s=570)

Then, here: ``python scripts/bench_big.py --from_json <files_at>/bench_big.json --out docs`` redraws
the figure, and the report's tables go to docs/benchmarks.md with the machine and that command.

Parts (``--parts cpu,gpu``):

- ``cpu``: the charlm job (``examples/train_charlm.py``, size tiny, ``bench.CHARLM_SMALL``'s flags,
  CPU ranks with ``OMP_NUM_THREADS=1``) at each world size of ``--worlds``;
- ``gpu``: the same job at size medium (about 90 MB of state) on 4 ranks sharing the one GPU
  (``--device cuda``: CUDA tensors, gradients averaged over gloo). Skipped with one line when
  ``torch.cuda.is_available()`` is false.

Each world size runs three jobs back to back, a triple: ftrun (its default warm spare), ftrun with
``--hot_spares 1`` (the kill comes at the first step from ``--kill_step`` on at which the hot spare
waits at the training loop; the job is long enough for the spare to be ready first, from its warm
twin's start-up and step time, at least ``--hot_steps``, shortened to what the budget leaves) and torchrun
(``--max-restarts 1``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, rank 0 checkpointing every
``--ckpt_every`` steps and every rank resuming from it, as in ``bench_recovery.py``). Rank
``--victim`` is SIGKILLed from outside when rank 0 prints the kill step. The running and the
measures are ``bench.run_job``'s (see ``scripts/bench.py``): recover_s (kill to rank 0 finishing the
failed step again), recomputed (steps run twice), step_s (the median step interval away from the
fault: the fault-free step time, from the same run) and ftrun's breakdown from its events. Ratios
are torchrun over each ftrun mode, pair by pair (the same repeat's torchrun run), printed as each
triple ends.

Time budget (``--budget_s``, default 480 s of runs: the command's 9 minutes less the wheel's
install, torch's import, the report and a margin). Each run's wall time is estimated by
:class:`Estimate`: process start-up and steps as CPU seconds spread over the cores, plus a ring
all-reduce's wait a rank, with constants measured on the 2-core machine (:data:`CPU_COST`; 307 s for one
repeat of the default plan on 16 cores). The model cannot know the lent machine (gVisor, other
CPUs), so every estimate is multiplied by the median ratio of measured to modelled wall time of the
runs done so far in the same part: the dry run here (``--worlds 2,4 --budget_s 1200``, 12 runs in
633 s, while other jobs' load average on the 2 cores fell from 21 to 7) took 10 times the model's
time in its first run; corrected, the later runs took 0.2 to 1.75 times their estimates, the load
changing under them. The runs go in order: every CPU world of the first repeat, smallest first, then
the second repeat's (``--repeats``, default 2), then the GPU part's. A triple is skipped (one line,
and in the JSON) unless its corrected estimate fits in what is left of the budget, less the GPU
part's estimate while that part is still to run, so the second repeat fills what the first leaves. A
run's timeout is four times its estimate (the first of a part: twenty times, the model being
uncorrected), within what is left. The results are rewritten after every run, so a command stopped
at its limit still leaves them in ``--out``.

Writes ``bench_big.json`` (every run raw, the machine, the command, estimates, skips and errors) and
``bench_big.png`` (recovery seconds and step time against world size, and the GPU part) under
``--out`` (default ``$OUT``, else ``bench_big_out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import CHARLM_SMALL, Case, Run, machine, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("ftrun", "ftrun-hot", "torchrun")
PARTS = ("cpu", "gpu")
GPU_RANKS = 4
GPU_SIZE = "medium"
DEFAULT_WORLDS = "8,16,32,64"


@dataclass(frozen=True)
class Cost:
    """The cost model of one part's runs, in seconds.

    ``start_cpu_s``: CPU time a process spends from its start to its first step (imports, corpus,
    model); ``step_cpu_s``: CPU time of one rank's step; ``hop_s``: wall time a step waits per rank
    in the ring all-reduce; ``fixed_s``: a run's own fixed wall time (launcher start, recovery
    rounds, the final evaluation and exit).
    """

    start_cpu_s: float
    step_cpu_s: float
    hop_s: float
    fixed_s: float


# Measured on the 2-core machine: one charlm-tiny process alone (CHARLM_SMALL's flags) took 3.7 s of
# CPU from its start to its exit with no step and 2.0 s more for 200 steps; hop_s and fixed_s are
# guesses. The GPU part's are guesses too (a CUDA context a process, the medium model's step). The
# first runs of each part correct them all (Estimate.factor).
CPU_COST = Cost(start_cpu_s=3.7, step_cpu_s=0.010, hop_s=0.0005, fixed_s=3.0)
GPU_COST = Cost(start_cpu_s=6.0, step_cpu_s=0.08, hop_s=0.01, fixed_s=8.0)


@dataclass(frozen=True)
class Spec:
    """One run of the plan: a ``part`` (cpu, gpu), a ``mode`` (of :data:`MODES`), its case and repeat."""

    part: str
    mode: str
    case: Case
    repeat: int

    @property
    def launcher(self) -> str:
        return "torchrun" if self.mode == "torchrun" else "ftrun"


@dataclass
class Estimate:
    """Wall-time estimates of runs on ``cores`` cores, corrected by the runs already measured.

    ``observed`` keeps, per part, the ratio measured / estimated of each finished run; every later
    estimate of that part is multiplied by their median (1.0 before the first).
    """

    cores: int
    costs: dict[str, Cost]
    observed: dict[str, list[float]] = field(default_factory=dict)

    def step_s(self, spec: Spec) -> float:
        """The model's step time of ``spec``: a rank's CPU, shared when there are more ranks than
        cores, and the all-reduce's wait for each rank of the ring."""
        cost, ranks = self.costs[spec.part], spec.case.ranks
        return cost.step_cpu_s * max(1.0, ranks / self.cores) + cost.hop_s * ranks

    def startup_s(self, spec: Spec) -> float:
        """The model's start-up of ``spec``'s ranks (with ftrun, its spares beside them)."""
        procs = spec.case.ranks + (0 if spec.mode == "torchrun" else 1 + (spec.mode == "ftrun-hot"))
        return self.costs[spec.part].start_cpu_s * max(1.0, procs / self.cores)

    def raw(self, spec: Spec) -> float:
        """The model's wall time of ``spec``, seconds: start-up, steps, fixed costs. torchrun starts
        every rank twice and resumes at the checkpoint before the kill; ftrun's respawned rank is
        a spare, its imports done."""
        case = spec.case
        if spec.mode == "torchrun":
            starts, steps = 2, case.steps + (case.kill_step or 0) % case.ckpt_every
        else:
            starts, steps = 1, case.steps
        return starts * self.startup_s(spec) + steps * self.step_s(spec) + self.costs[spec.part].fixed_s

    def factor(self, part: str) -> float:
        return statistics.median(self.observed[part]) if self.observed.get(part) else 1.0

    def of(self, spec: Spec) -> float:
        """The corrected estimate of ``spec``, seconds."""
        return self.raw(spec) * self.factor(spec.part)

    def observe(self, spec: Spec, seconds: float) -> None:
        """Record that ``spec`` took ``seconds`` of wall time."""
        self.observed.setdefault(spec.part, []).append(seconds / self.raw(spec))


# ------------------------------------------------------------------------------------------ plan
def parse_worlds(text: str) -> list[int]:
    """``"8,16,32,64"`` -> ``[8, 16, 32, 64]``. Raises ValueError unless each is an integer of 2 or more."""
    try:
        worlds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--worlds {text!r}: comma-separated integers, e.g. 8,16,32,64") from None
    if not worlds or min(worlds) < 2:
        raise ValueError(f"--worlds {text!r}: each world size must be 2 or more")
    return worlds


def parse_parts(text: str) -> list[str]:
    """``"cpu,gpu"`` -> ``["cpu", "gpu"]``. Raises ValueError on a part not in :data:`PARTS`."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"--parts {text!r}: choose from {', '.join(PARTS)}")
    return parts


def hot_steps(kill_step: int, startup_s: float, step_s: float, floor: int, ceiling: int) -> int:
    """Steps of a hot-spare job long enough for the kill to find the spare ready: the hot spare
    starts once every rank has begun its first step and pays the script's set-up (about what the
    ranks paid, ``startup_s``) while they train at ``step_s`` a step; half as long again and 5 s
    more, then 10 steps to recover in; within [floor, ceiling]."""
    wanted = kill_step + math.ceil((1.5 * startup_s + 5.0) / max(step_s, 1e-3)) + 10
    return max(floor, min(ceiling, wanted))


def triples(args: argparse.Namespace, parts: list[str], worlds: list[int]) -> list[list[Spec]]:
    """The runs, three at a time (ftrun, ftrun-hot, torchrun on one job), in the order they run:
    each repeat of the CPU worlds, smallest first, then the GPU part's repeats."""
    common = dict(kill_step=args.kill_step, victim=args.victim, ckpt_every=args.ckpt_every)
    jobs: list[tuple[str, int, str, tuple[str, ...]]] = []
    if "cpu" in parts:
        jobs += [("cpu", w, "tiny", CHARLM_SMALL) for w in worlds]
    if "gpu" in parts:
        jobs.append(("gpu", GPU_RANKS, GPU_SIZE, (*CHARLM_SMALL, "--device", "cuda")))
    out = []
    for part in ("cpu", "gpu"):
        for repeat in range(args.repeats):
            for job_part, ranks, size, flags in jobs:
                if job_part != part:
                    continue
                case = Case("charlm", size, ranks, args.steps, args=flags, **common)
                hot = Case("charlm", size, ranks, args.hot_steps, args=flags, hot=True, **common)
                out.append([Spec(part, "ftrun", case, repeat), Spec(part, "ftrun-hot", hot, repeat),
                            Spec(part, "torchrun", case, repeat)])
    return out


# ------------------------------------------------------------------------------------------ running
class Bench:
    """Runs the plan within the budget and keeps the results (``results``: what the JSON holds).

    ``job`` runs one case under one launcher (``bench.run_job``; a test passes a fake), ``clock``
    gives the time (``time.monotonic``), ``hot_range`` bounds a hot-spare job's steps (see
    :func:`hot_steps`: sized from the model before a triple, from its warm ftrun run after it).
    """

    def __init__(self, estimate: Estimate, budget_s: float, out: Path, command: str, hot_range: tuple[int, int],
                 job: Callable[..., Run] = run_job, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = print) -> None:
        self.estimate, self.budget_s, self.out, self.hot_range = estimate, budget_s, out, hot_range
        self.job, self.clock, self.say = job, clock, say
        self.started = clock()
        self.results: dict[str, Any] = {"command": command, "budget_s": budget_s, "cores": estimate.cores,
                                        "parts": {}, "skipped": [], "errors": [], "estimates": []}

    def left(self) -> float:
        return self.budget_s - (self.clock() - self.started)

    def run(self, plan: list[list[Spec]]) -> dict[str, Any]:
        """Run each triple that fits in what is left of the budget (the GPU part's estimate kept
        back while it is still to run); print each triple's figures as it ends."""
        for index, planned in enumerate(plan):
            warm, hot, torchrun = planned
            need = self.need(planned)
            reserve = sum(self.need(t) for t in plan[index + 1:] if t[0].part == "gpu" and warm.part != "gpu")
            if need > self.left() - reserve:
                line = (f"[{warm.part}] x{warm.case.ranks} repeat {warm.repeat + 1} skipped: estimated "
                        f"{need:.0f} s, {self.left():.0f} s left" + (f", {reserve:.0f} s kept for the GPU part" if reserve else ""))
                self.say(line)
                self.results["skipped"].append(line)
                continue
            measured = self.one(warm, self.timeout(warm, reserve))
            for spec in (self.fit(self.sized(hot, warm, measured), torchrun, reserve), torchrun):
                self.one(spec, self.timeout(spec, reserve))
            self.say(pair_line([r for r in self.results["parts"].get(warm.part, [])
                                if r["case"]["ranks"] == warm.case.ranks and r["repeat"] == warm.repeat]))
        return self.results

    def need(self, triple: list[Spec]) -> float:
        """The estimated seconds of ``triple`` (its hot-spare job sized by the model)."""
        warm, hot, torchrun = triple
        return sum(self.estimate.of(s) for s in (warm, self.sized(hot, warm, None), torchrun))

    def sized(self, hot: Spec, warm: Spec, measured: Run | None) -> Spec:
        """``hot`` with its job's steps from :func:`hot_steps`: the start-up and step time of the
        warm ftrun run ``measured`` of the same job (its total less its steps and its recovery),
        or the model's (corrected) when there is none."""
        if measured is not None and measured.step_s:
            step = measured.step_s
            startup = max(1.0, measured.total_s - warm.case.steps * step - (measured.recover_s or 0.0))
        else:
            factor = self.estimate.factor(warm.part)
            step, startup = self.estimate.step_s(warm) * factor, self.estimate.startup_s(warm) * factor
        steps = hot_steps(hot.case.kill_step or 0, startup, step, *self.hot_range)
        return replace(hot, case=replace(hot.case, steps=steps))

    def fit(self, hot: Spec, after: Spec, reserve: float) -> Spec:
        """``hot`` with fewer steps (a fifth fewer at a time, not under the floor of ``hot_range``)
        while it and ``after`` are estimated to need more than what is left less ``reserve``."""
        while hot.case.steps > self.hot_range[0] and (
                self.estimate.of(hot) + self.estimate.of(after) > self.left() - reserve):
            hot = replace(hot, case=replace(hot.case, steps=max(self.hot_range[0], int(hot.case.steps * 0.8))))
        return hot

    def timeout(self, spec: Spec, reserve: float) -> float:
        """Seconds ``spec`` may run: four times its estimate (at least 60), or, for the first run of
        its part (the model not yet corrected), twenty times (at least 180) within what is left less
        ``reserve``; never past the budget, never under 30 s."""
        left = self.left()
        if not self.estimate.observed.get(spec.part):
            return max(30.0, min(max(180.0, 20 * self.estimate.of(spec)), left - reserve))
        return max(30.0, min(max(60.0, 4 * self.estimate.of(spec)), left))

    def one(self, spec: Spec, timeout: float) -> Run | None:
        """Run ``spec``, print and keep what it measured (or its error); None if it failed."""
        estimate = self.estimate.of(spec)
        self.say(f"[{spec.part}] x{spec.case.ranks} {spec.mode} repeat {spec.repeat + 1}: {spec.case.steps} steps, "
                 f"estimated {estimate:.0f} s ...")
        began = self.clock()
        run: Run | None = None
        try:
            run = self.job(spec.launcher, spec.case, timeout=timeout)
        except RuntimeError as err:  # the rest goes on; the error is in the JSON
            text = str(err)
            first = (text.splitlines()[0] if text else "?") + (
                f" (stopped at its timeout, {timeout:.0f} s)" if self.clock() - began >= timeout - 1 else "")
            self.say(f"    FAILED: {first}")
            self.results["errors"].append(f"{spec.part} x{spec.case.ranks} {spec.mode}: {first}\n{text[-3000:]}")
        took = self.clock() - began
        self.estimate.observe(spec, took)
        if run is not None:
            self.results["parts"].setdefault(spec.part, []).append(
                asdict(run) | {"mode": spec.mode, "repeat": spec.repeat, "part": spec.part})
            self.say(f"    recover {_fmt(run.recover_s)} s, recomputed {_fmt(run.recomputed, 0)}, "
                     f"step {_fmt(run.step_s and run.step_s * 1e3, 1)} ms, total {took:.1f} s")
        self.results["estimates"].append({"part": spec.part, "ranks": spec.case.ranks, "mode": spec.mode,
                                          "repeat": spec.repeat, "steps": spec.case.steps,
                                          "estimated_s": round(estimate, 1), "took_s": round(took, 1)})
        write_json(self.results, self.out)
        return run


# ------------------------------------------------------------------------------------------ report
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def by_mode(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """mode -> repeat -> run, of one world size's runs."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["mode"], {})[r["repeat"]] = r
    return out


def ratios(rows: list[dict[str, Any]], mode: str) -> list[float]:
    """torchrun's recovery time over ``mode``'s, one per repeat that has both (pair by pair)."""
    runs = by_mode(rows)
    mine, theirs = runs.get(mode, {}), runs.get("torchrun", {})
    return [theirs[k]["recover_s"] / mine[k]["recover_s"] for k in sorted(mine)
            if k in theirs and mine[k]["recover_s"] and theirs[k]["recover_s"]]


def pair_line(rows: list[dict[str, Any]]) -> str:
    """One triple's figures (one world size, one repeat): each mode's recovery, recomputed steps and
    step time, and torchrun/ftrun pair by pair."""
    if not rows:
        return "    (no run of this triple succeeded)"
    runs = {r["mode"]: r for r in rows}
    head = f"  => {rows[0]['part']} x{rows[0]['case']['ranks']} repeat {rows[0]['repeat'] + 1}: "
    cells = [f"{m} {_fmt(r['recover_s'])} s ({_fmt(r['recomputed'], 0)} recomputed, "
             f"step {_fmt(r['step_s'] and r['step_s'] * 1e3, 1)} ms)" for m, r in runs.items()]
    pairs = [f"torchrun/{m} {q[0]:.1f}x" for m in ("ftrun", "ftrun-hot") if (q := ratios(rows, m))]
    return head + "; ".join(cells) + ("; " + ", ".join(pairs) if pairs else "")


def _median(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> float | None:
    values = [r[key] * scale for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(runs: list[dict[str, Any]]) -> list[str]:
    """One row per world size and mode: medians over repeats; x/mode: torchrun/that mode, the
    median of the pairwise ratios."""
    out = [f"{'ranks':>5} {'mode':<10} {'runs':>4} {'failed':>6} {'recover_s':>9} {'spread':>6} {'recomp':>6} "
           f"{'step_ms':>7} {'total_s':>7} {'tr/mode':>7}"]
    for ranks in sorted({r["case"]["ranks"] for r in runs}):
        rows = [r for r in runs if r["case"]["ranks"] == ranks]
        for mode in MODES:
            mine = [r for r in rows if r["mode"] == mode]
            if not mine:
                continue
            rec = [r["recover_s"] for r in mine if r["recover_s"] is not None]
            q = ratios(rows, mode) if mode != "torchrun" else []
            out.append(f"{ranks:>5} {mode:<10} {len(mine):>4} {_fmt(_median(mine, 'failed_step'), 0):>6} "
                       f"{_fmt(_median(mine, 'recover_s')):>9} {_fmt(max(rec) - min(rec) if rec else None):>6} "
                       f"{_fmt(_median(mine, 'recomputed'), 0):>6} {_fmt(_median(mine, 'step_s', 1e3), 1):>7} "
                       f"{_fmt(_median(mine, 'total_s'), 1):>7} {(f'{statistics.median(q):.1f}x' if q else '-'):>7}")
    return out


def breakdown(runs: list[dict[str, Any]]) -> list[str]:
    """Where ftrun's recovery goes (medians, seconds; ``bench.ftrun_breakdown``'s parts) by world size and mode."""
    from bench import BREAKDOWN

    out = [f"{'ranks':>5} {'mode':<10} " + " ".join(f"{p:>9}" for p in BREAKDOWN)]
    for ranks in sorted({r["case"]["ranks"] for r in runs}):
        for mode in ("ftrun", "ftrun-hot"):
            mine = [r for r in runs if r["case"]["ranks"] == ranks and r["mode"] == mode and r["breakdown"]]
            if mine:
                out.append(f"{ranks:>5} {mode:<10} " + " ".join(
                    f"{_fmt(statistics.median(r['breakdown'].get(p, 0.0) for r in mine), 3):>9}" for p in BREAKDOWN))
    return out


def report(results: dict[str, Any]) -> str:
    """Every part's tables, as text."""
    m = results.get("machine") or {}
    lines = [f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gb', '?')} GiB, "
             f"GPU {m.get('gpu') or 'none'}, Python {m.get('python', '?')}, torch {m.get('torch', '?')}; "
             f"ftrun {m.get('ftrun_commit', '?')}",
             f"command: {results.get('command', '?')}",
             f"budget {results.get('budget_s', '?')} s of runs; took {results.get('took_s', '?')} s"]
    titles = {"cpu": "charlm tiny, CPU ranks (OMP_NUM_THREADS=1)",
              "gpu": f"charlm {GPU_SIZE}, {GPU_RANKS} ranks sharing one GPU (CUDA tensors over gloo)"}
    for part in PARTS:
        runs = results["parts"].get(part)
        if runs:
            lines += ["", f"== {part}: {titles[part]}; SIGKILL of one rank mid-run; recovery seconds, steps recomputed, "
                          "step time away from the fault (tr/mode: torchrun/mode, pairwise median)"]
            lines += table(runs)
            lines += ["", f"== {part}: where ftrun's recovery time goes (medians, seconds)"]
            lines += breakdown(runs)
    for key, title in (("skipped", "skipped"), ("errors", "failed runs (their output is in the JSON)")):
        if results.get(key):
            lines += ["", f"{title}:"] + [f"  {line.splitlines()[0][:200]}" for line in results[key]]
    return "\n".join(lines)


def write_json(results: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_big.json"
    path.write_text(json.dumps(results, indent=1))
    return path


def plot(results: dict[str, Any], out: Path) -> Path | None:
    """``bench_big.png``: recovery seconds and step time against world size (CPU part, one line a
    mode, median with min..max bars), and the GPU part's recovery per mode. None without matplotlib
    or without runs."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu, gpu = results["parts"].get("cpu", []), results["parts"].get("gpu", [])
    if not cpu and not gpu:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, scale, label in ((axes[0], "recover_s", 1.0, "recovery (s): kill -> failed step done"),
                                  (axes[1], "step_s", 1e3, "step time away from the fault (ms)")):
        for mode, marker in zip(MODES, "os^"):
            points: dict[int, list[float]] = {}
            for r in cpu:
                if r["mode"] == mode and r.get(key) is not None:
                    points.setdefault(r["case"]["ranks"], []).append(r[key] * scale)
            xs = sorted(points)
            if not xs:
                continue
            med = [statistics.median(points[x]) for x in xs]
            bars = [[m - min(points[x]) for m, x in zip(med, xs)], [max(points[x]) - m for m, x in zip(med, xs)]]
            ax.errorbar(xs, med, yerr=bars, marker=marker, capsize=3, label=mode)
        ax.set_xscale("log", base=2)
        ranks = sorted({r["case"]["ranks"] for r in cpu})
        ax.set_xticks(ranks, [str(x) for x in ranks])
        ax.set_xlabel("world size (CPU ranks)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    modes = [m for m in MODES if any(r["mode"] == m and r["recover_s"] is not None for r in gpu)]
    if modes:
        axes[2].bar(modes, [statistics.median(r["recover_s"] for r in gpu if r["mode"] == m and r["recover_s"] is not None)
                            for m in modes], color=["C0", "C1", "C2"][:len(modes)])
        axes[2].set_ylabel("recovery (s)")
        axes[2].set_title(f"GPU: charlm {GPU_SIZE}, {GPU_RANKS} ranks sharing it")
    else:
        axes[2].axis("off")
        axes[2].text(0.5, 0.5, "GPU part: not run", ha="center", va="center")
    cores = (results.get("machine") or {}).get("cores", "?")
    fig.suptitle(f"ftrun (warm spare, hot spare) against torchrun, one rank SIGKILLed; {cores} cores")
    fig.tight_layout()
    path = out / "bench_big.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gpu_name() -> str | None:
    """The first GPU's name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="cpu, gpu or both (default cpu,gpu)")
    parser.add_argument("--worlds", default=DEFAULT_WORLDS, help=f"CPU world sizes (default {DEFAULT_WORLDS})")
    parser.add_argument("--steps", type=int, default=30, help="steps of the ftrun (warm) and torchrun jobs (default 30)")
    parser.add_argument("--hot_steps", type=int, default=60,
                        help="the fewest steps of the hot-spare job (default 60; more when its warm twin's start-up "
                             "and step time say the spare would not be ready by then: see hot_steps)")
    parser.add_argument("--hot_steps_max", type=int, default=3000, help="the most steps of the hot-spare job (default 3000)")
    parser.add_argument("--kill_step", type=int, default=15, help="the step at which the victim is killed (default 15)")
    parser.add_argument("--ckpt_every", type=int, default=10, help="torchrun's checkpoint interval, steps (default 10)")
    parser.add_argument("--victim", type=int, default=1, help="the rank killed (default 1)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="triples of each world size (default 2; a second repeat runs where the budget leaves room)")
    parser.add_argument("--budget_s", type=float, default=480.0, help="wall seconds for all runs (default 480)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench_big_out",
                        help="where bench_big.json and bench_big.png go (default $OUT, else bench_big_out)")
    parser.add_argument("--from_json", default=None, help="report and plot this JSON again; run nothing")
    args = parser.parse_args(argv)
    try:
        args.part_list = parse_parts(args.parts)
        args.world_list = parse_worlds(args.worlds)
    except ValueError as err:
        parser.error(str(err))
    if not 0 < args.kill_step < min(args.steps, args.hot_steps) - 2:
        parser.error(f"--kill_step {args.kill_step}: between 1 and the shorter job's steps less 3")
    if any(w <= args.victim for w in args.world_list) or (("gpu" in args.part_list) and GPU_RANKS <= args.victim):
        parser.error(f"--victim {args.victim}: not a rank of every world size")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        # The ranks import ftrun from this tree (the lent machine has it installed nowhere).
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        parts = args.part_list
        gpu = gpu_name() if "gpu" in parts else None
        if "gpu" in parts and gpu is None:
            print("[gpu] skipped: torch.cuda.is_available() is false on this machine")
            parts = [p for p in parts if p != "gpu"]
        estimate = Estimate(os.cpu_count() or 1, {"cpu": CPU_COST, "gpu": GPU_COST})
        plan = triples(args, parts, args.world_list)
        bench = Bench(estimate, args.budget_s, out, " ".join(["python scripts/bench_big.py", *(argv or sys.argv[1:])]),
                      (args.hot_steps, args.hot_steps_max), say=lambda line: print(line, flush=True))
        print(f"plan: {sum(len(t) for t in plan)} runs, estimated {sum(bench.need(t) for t in plan):.0f} s on "
              f"{estimate.cores} cores (before any correction); budget {args.budget_s:.0f} s", flush=True)
        bench.results["machine"] = machine() | {"gpu": gpu}
        results = bench.run(plan)
        results["took_s"] = round(time.monotonic() - bench.started, 1)
        results["correction"] = {p: round(estimate.factor(p), 2) for p in parts}
    print(report(results))
    print(f"wrote {write_json(results, out)}")
    figure = plot(results, out)
    print(f"wrote {figure}" if figure else "no plot (matplotlib missing, or no run)")


if __name__ == "__main__":
    main()

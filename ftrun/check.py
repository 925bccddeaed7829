"""``ftrun check SCRIPT [ARGS...]``: is a training script exactly-once under ftrun? (issue 20)

ftrun's promise (a run with recovered faults ends with the parameters of the run without) holds
only if everything the script carries from step to step is either recomputed from the step or
registered (README: "Porting a script"). A script can break it silently: a hidden state carried
from batch to batch, a learning rate in a module-level variable, a best-so-far value, a random
generator of its own. This command finds out before production, on a small world:

1. a fault-free run, traced: each rank writes, at ``ft.finish()``, a fingerprint of every parameter
   after every committed step, the first step of each epoch and the sections it opened
   (``FTRUN_CHECK_TRACE``, :meth:`ftrun.worker.Worker.finish`);
2. runs with one rank killed where scripts go wrong: in the all-reduce of a step in the middle of
   the first epoch (the survivors compute the step again), right after an epoch's last step (the
   survivors run the epoch's end and the next epoch's prologue before the new rank joins), before
   the forward pass of the last epoch's first step, and inside a section (an evaluation);
3. each run's traces against the fault-free ones: the first step and parameter tensor that differ,
   the ``divergence`` events of the run (a step computed again with another local gradient), and
   from both the likely cause.

Exit code 0: exactly-once in every run; 1: not (the report says where and why); 2: the script did
not run (its fault-free run failed) or a user error. The control side: no torch here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Scenario:
    """One faulted run: what it is, and its ``FTRUN_FAULT``; ``kind`` is its name for
    ``--scenarios`` (one of :data:`SCENARIO_KINDS`)."""

    name: str
    fault: str
    step: int
    kind: str = ""


#: The faulted runs ``ftrun check`` can make, by the name ``--scenarios`` takes.
SCENARIO_KINDS = {
    "allreduce": "a kill in a step's all-reduce, mid-epoch (the survivors compute the step again)",
    "epoch_end": "a kill right after an epoch's last step",
    "epoch_start": "a kill before the forward pass of an epoch's first step",
    "section": "a kill inside an ft.section()",
}


def parse_scenarios(text: str | None) -> set[str] | None:
    """``--scenarios`` (comma-separated kinds) as a set; None (or empty): every scenario.

    Raises:
        ValueError: an unknown kind (the message names it and the known ones).
    """
    if not text:
        return None
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    unknown = sorted(kinds - set(SCENARIO_KINDS))
    if unknown:
        raise ValueError(f"--scenarios {text}: unknown scenario {', '.join(unknown)}; choose from "
                         f"{', '.join(SCENARIO_KINDS)}")
    return kinds


@dataclass
class Trace:
    """The traces of one run, by rank: ``{rank: doc}`` of the newest incarnation of each rank."""

    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> "Trace":
        trace = cls()
        for path in sorted(directory.glob("trace_rank*_inc*.json")):
            doc = json.loads(path.read_text())
            rank = int(doc["rank"])
            if rank not in trace.ranks or int(doc["incarnation"]) > int(trace.ranks[rank]["incarnation"]):
                trace.ranks[rank] = doc
        return trace

    def divergences(self) -> list[dict[str, Any]]:
        return [dict(d, rank=r) for r, doc in sorted(self.ranks.items()) for d in doc.get("divergences", [])]


@dataclass
class Difference:
    """Where a faulted run first differs from the fault-free one."""

    step: int
    rank: int
    tensor: str


def first_difference(reference: Trace, run: Trace) -> Difference | None:
    """The earliest committed step at which some rank's parameters differ between the runs (and
    the first parameter tensor, in the model's order, that differs there); also the final state."""
    found: Difference | None = None
    for rank, ref in reference.ranks.items():
        doc = run.ranks.get(rank)
        if doc is None:
            continue
        names = ref["names"]
        steps = sorted(set(ref["steps"]) & set(doc["steps"]), key=int)
        for step in steps:
            a, b = ref["steps"][step], doc["steps"][step]
            if a != b:
                index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 0)
                if found is None or int(step) < found.step:
                    found = Difference(int(step), rank, names[index] if index < len(names) else "?")
                break
    return found


def choose_scenarios(reference: Trace, world: int) -> list[Scenario]:
    """The faulted runs for a script whose fault-free run gave ``reference`` (rank 0's trace: its
    committed steps, epochs and sections); the last rank is the one killed."""
    doc = reference.ranks[0]
    steps = sorted(int(s) for s in doc["steps"])
    if not steps:
        return []
    last_step = steps[-1]
    victim = world - 1
    epochs = [(int(e["epoch"]), int(e["first_step"])) for e in doc.get("epochs", [])]
    bounds = [(first, (epochs[i + 1][1] if i + 1 < len(epochs) else last_step + 1) - 1)
              for i, (_, first) in enumerate(epochs)]
    bounds = [(a, b) for a, b in bounds if b >= a]
    out: list[Scenario] = []
    if len(bounds) >= 2:
        first_a, first_b = bounds[0]
        mid = max(first_a + 1, (first_a + first_b) // 2)
        out.append(Scenario(f"a kill in the all-reduce of step {mid}, mid-epoch (the survivors compute it again)",
                            f"rank={victim},step={mid},point=allreduce,kind=kill", mid, "allreduce"))
        end = bounds[-2][1]
        out.append(Scenario(f"a kill right after step {end}, an epoch's last (the survivors run the epoch's end and "
                            "the next epoch's start before the new rank joins)",
                            f"rank={victim},step={end},point=between_steps,kind=kill", end, "epoch_end"))
        start = bounds[-1][0]
        out.append(Scenario(f"a kill before the forward pass of step {start}, the last epoch's first",
                            f"rank={victim},step={start},point=before_forward,kind=kill", start, "epoch_start"))
    else:
        for step, point, what, kind in ((max(1, last_step // 3), "allreduce", "in the all-reduce of", "allreduce"),
                                        (max(1, last_step // 2), "between_steps", "right after", "epoch_end"),
                                        (max(1, 2 * last_step // 3), "before_forward", "before the forward pass of",
                                         "epoch_start")):
            out.append(Scenario(f"a kill {what} step {step}", f"rank={victim},step={step},point={point},kind=kill", step,
                                kind))
    sections = [s for s in doc.get("sections", []) if 0 <= int(s["committed"]) < last_step]
    if sections:
        pick = sections[len(sections) // 2]
        out.append(Scenario(f"a kill inside ft.section({pick['name']!r}) after step {pick['committed']}",
                            f"rank={victim},step={pick['committed']},point=section,kind=kill", int(pick["committed"]),
                            "section"))
    return out


def explain(diff: Difference | None, divergences: list[dict[str, Any]], scenario: Scenario, reference: Trace) -> str:
    """The likely cause of a difference, in words, from where it appears and what the run saw."""
    gradient = [d for d in divergences if d["check"] == "gradient"]
    replicas = [d for d in divergences if d["check"] == "replica_parameters"]
    epoch_end = [d for d in divergences if d["check"] == "epoch_end_rng"]
    if epoch_end:
        d = epoch_end[0]
        return (f"the end of the epoch that ends with step {d['step']} draws from the global random generators on "
                f"every rank (an evaluation DataLoader's iter() draws a seed from torch's even with num_workers=0; "
                "dropout left in train mode in an evaluation; a random sample), and rank "
                f"{d['rank']} replaced a process that died before that end was over, so its random streams cannot "
                "be its predecessor's. Give what the epoch's end draws its own generator, e.g. "
                "DataLoader(test_set, generator=torch.Generator()), in the script and its twin")
    if gradient:
        d = gradient[0]
        return (f"rank {d['rank']} computed step {d['step']} again and got another local gradient: the forward or "
                "backward pass depends on state that ftrun does not restore when a step is retried or a rank "
                "replaced -- a tensor carried from one batch to the next (an RNN's hidden state, a memory, a "
                "running statistic kept outside a module), a counter or flag in a module-level variable, or a random "
                "generator of the script's own. Register it: ft.register(name, obj, kind=\"rank\") for what is each "
                "rank's own, kind=\"replica\" for what is the same on every replica")
    if replicas:
        d = replicas[0]
        return (f"after the recovery to step {d['step']} the replicas' parameters differ: the state a donor sent did not "
                "make the new rank equal to its replicas (a model or optimizer built differently on a respawned rank, "
                "or state changed before the loop that is not registered)")
    if diff is None:
        return "the final parameters differ, but no traced step does: something after the last step changes them"
    epochs = [int(e["first_step"]) for e in reference.ranks[0].get("epochs", [])]
    later = [s for s in epochs if scenario.step < s <= diff.step]
    where = f" (from step {diff.step}, after the epoch boundary at step {later[-1]})" if later else ""
    return ("the gradients computed again were the same (no check saw a difference), but the updates are not: what the optimizer step or its "
            "hyperparameters depend on lives outside the registered state on the new rank -- a learning rate or "
            "another value in a module-level variable, a scheduler not registered, a best-so-far value or a plateau "
            f"or early-stopping counter that decides an annealing at an epoch's end{where}. Register it as replica "
            "state: ft.register(name, obj) with state_dict()/load_state_dict()")


def _run(script: str, args: list[str], world: int, workdir: Path, fault: str | None, timeout: float) -> tuple[int, str, Path]:
    trace_dir = workdir / "trace"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    env["FTRUN_CHECK_TRACE"] = str(trace_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["FTRUN_FAULT"] = fault
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(world), "--master_port", "0", "--plain",
           "--log_dir", str(workdir / "logs"), "--tail_worker_log", "", "--max_restarts", "3",
           "--checkpoint_dir", str(workdir / "checkpoints"), "--resume", "none", "--on_divergence", "warn",
           script, *args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, trace_dir
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out, trace_dir


def check(script: str, args: list[str], world: int = 2, timeout: float = 600.0, keep: str | None = None,
          say: Callable[[str], None] = print, only: set[str] | None = None) -> int:
    """Run the check (module docstring); returns the exit code (0 exactly-once, 1 not, 2 could not run).

    Args:
        script: the training script (a path); args: its arguments.
        world: ranks per run (at least 2: a respawned rank takes state from a replica).
        timeout: seconds per run.
        keep: a directory to keep every run's logs and traces in (default: a temporary one, removed).
        say: where the report's lines go.
        only: the scenario kinds to run (:data:`SCENARIO_KINDS`; None: every one that applies).
    """
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ftrun_check_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        say(f"ftrun check: {script} on {world} ranks: a fault-free run, then runs with rank {world - 1} killed")
        code, out, trace_dir = _run(script, args, world, root / "reference", None, timeout)
        reference = Trace.load(trace_dir)
        if code != 0 or 0 not in reference.ranks:
            say(f"ftrun check: the fault-free run failed (exit code {code}); nothing to compare. Its output ends:")
            for line in out.strip().splitlines()[-15:]:
                say("  " + line)
            return 2
        if not reference.ranks[0]["names"] or not reference.ranks[0]["steps"]:
            say("ftrun check: the script registers no model (ft.wrap_model) or commits no step: nothing to compare")
            return 2
        scenarios = [s for s in choose_scenarios(reference, world) if only is None or s.kind in only]
        failures = 0
        for i, scenario in enumerate(scenarios):
            code, out, trace_dir = _run(script, args, world, root / f"fault{i}", scenario.fault, timeout)
            run = Trace.load(trace_dir)
            if code != 0:
                failures += 1
                say(f"  FAIL  {scenario.name}: the job failed (exit code {code}); its output ends:")
                for line in out.strip().splitlines()[-8:]:
                    say("          " + line)
                continue
            diff = first_difference(reference, run)
            divergences = run.divergences()
            if diff is None and not divergences:
                say(f"  ok    {scenario.name}: bitwise equal")
                continue
            failures += 1
            where = (f"first differs after step {diff.step} (rank {diff.rank}), in parameter {diff.tensor}"
                     if diff is not None else "the parameters end equal, but a divergence was detected")
            say(f"  FAIL  {scenario.name}: {where}")
            say(f"        likely cause: {explain(diff, divergences, scenario, reference)}")
        if failures:
            say(f"ftrun check: NOT exactly-once: {failures} of {len(scenarios)} faulted run(s) differ from the fault-free "
                "run (README: Porting a script)")
            return 1
        say(f"ftrun check: exactly-once: {len(scenarios)} faulted run(s) end bitwise equal to the fault-free run")
        return 0
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)

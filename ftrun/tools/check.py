"""``ftrun check SCRIPT [ARGS...]``: is a training script exactly-once under ftrun?

ftrun's promise (a run with recovered faults ends with the parameters and buffers of the run
without) holds only if everything the script carries from step to step is either recomputed from
the step or registered (docs/porting.md). A script can break it silently: a second
model or optimizer not registered, a hidden state carried from batch to batch, a learning rate in
a module-level variable, a best-so-far value, a random generator of its own, buffers (BatchNorm's
statistics) changed by a forward pass computed again. This command finds out before production,
on a small world:

1. a fault-free run, traced (:mod:`ftrun.rank.trace`): each rank writes, at ``ft.finish()``, after
   every committed step a fingerprint of every parameter and buffer of the registered modules and
   of every module and optimizer the script holds that is not registered, how many times the step
   reached each fault point (its all-reduces and optimizer updates), the first step of each epoch
   and the sections it opened;
2. runs with the last rank killed where scripts go wrong: in the all-reduce of a step in the middle
   of the first epoch (the survivors compute the step again); when that step has several all-reduces
   (several backward passes, or one through several models) or several optimizer updates, in each
   of the others and in each update (``FTRUN_FAULT``'s ``nth``); right after an epoch's last step
   (the survivors run the epoch's end and the next epoch's prologue before the new rank joins);
   before the forward pass of the last epoch's first step; and inside a section (an evaluation);
3. each run's traces against the fault-free ones: the first step and tensor that differ (a
   parameter or buffer of a registered object, or an unregistered module or optimizer), the
   ``divergence`` events of the run (a step computed again with another local gradient), and from
   both the likely cause.

Exit code 0: exactly-once in every run; 1: not (the report says where and why); 2: the script did
not run (its fault-free run failed) or a user error. The control side: no torch here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ftrun.common.procs import ftrun_module_argv

# What a traced tensor is: the values of a trace's "kinds" (ftrun.rank.trace, which imports torch).
PARAMETER = "parameter"
BUFFER = "buffer"
UNREGISTERED_MODULE = "unregistered module"
UNREGISTERED_OPTIMIZER = "unregistered optimizer"
UNREGISTERED = (UNREGISTERED_MODULE, UNREGISTERED_OPTIMIZER)
# Which difference of one step is named first: what ftrun does not know about explains the rest
# (a second model not registered changes the registered one's gradients); a buffer changed by a
# forward pass shows before the parameters its statistics feed.
_PRIORITY = {UNREGISTERED_MODULE: 0, UNREGISTERED_OPTIMIZER: 0, BUFFER: 1, PARAMETER: 2}
_BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


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
    "allreduce": "a kill in a step's (first) all-reduce, mid-epoch (the survivors compute the step again)",
    "epoch_end": "a kill right after an epoch's last step",
    "epoch_start": "a kill before the forward pass of an epoch's first step",
    "section": "a kill inside an ft.section()",
    "backward": "a kill in each other all-reduce of the allreduce scenario's step, when it has several (several "
                "backward passes, or one through several wrapped models)",
    "update": "a kill in each optimizer update of that step, when it has several all-reduces or updates",
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
    """The traces of one run, by rank: ``{rank: doc}`` of the newest incarnation of each rank
    (the document :meth:`ftrun.rank.trace.RunTrace.write` writes)."""

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

    def unregistered(self) -> dict[str, str]:
        """``{name: "module" | "optimizer"}`` of the unregistered objects any rank found."""
        return {n: k for _, doc in sorted(self.ranks.items()) for n, k in doc.get("unregistered", {}).items()}


@dataclass(frozen=True)
class TracedTensor:
    """One entry of a trace: its name, what it is (:data:`PARAMETER`, :data:`BUFFER`,
    :data:`UNREGISTERED_MODULE`, :data:`UNREGISTERED_OPTIMIZER`) and the registered or script
    name of the object it belongs to."""

    name: str
    kind: str
    owner: str


def layout(doc: dict[str, Any]) -> list[TracedTensor]:
    """A trace document's entries, in order (a document without ``kinds``: parameters, each owned
    by its name's first component)."""
    names = doc["names"]
    kinds = doc.get("kinds") or [PARAMETER] * len(names)
    owners = doc.get("owners") or [n.split(".", 1)[0] for n in names]
    return [TracedTensor(n, k, o) for n, k, o in zip(names, kinds, owners)]


@dataclass
class Difference:
    """Where a faulted run first differs from the fault-free one: after committed ``step``, on
    ``rank``, in the traced entry ``tensor`` (a :class:`TracedTensor`'s name) of kind ``kind``
    belonging to ``owner``."""

    step: int
    rank: int
    tensor: str
    kind: str = PARAMETER
    owner: str = ""

    def describe(self) -> str:
        """Where, in words: ``in parameter model.encoder.weight``, ``in buffer netD.main.1.running_mean``,
        ``in netG, a module not registered with ftrun (its main.0.weight)``."""
        if self.kind == UNREGISTERED_MODULE:
            return f"in {self.owner}, a module not registered with ftrun (its {_own_part(self)})"
        if self.kind == UNREGISTERED_OPTIMIZER:
            part = {"state": "state", "param_groups": "hyperparameters", "params": "parameters"}.get(_own_part(self),
                                                                                                  _own_part(self))
            return f"in {self.owner}, an optimizer not registered with ftrun (its {part})"
        return f"in {self.kind} {self.tensor}"


def _own_part(diff: Difference) -> str:
    prefix = f"unregistered:{diff.owner}."
    return diff.tensor[len(prefix):] if diff.tensor.startswith(prefix) else diff.tensor


def first_difference(reference: Trace, run: Trace, kinds: tuple[str, ...] | None = None) -> Difference | None:
    """The earliest committed step at which some rank's traced tensors differ between the runs,
    and there the first entry that differs: an unregistered object's before a buffer, a buffer
    before a parameter, else in the trace's order (the model's); on the lowest such rank.

    Args:
        reference: the fault-free run's traces; run: a faulted run's.
        kinds: only entries of these kinds (None: all).

    Entries are matched by name, so traces whose layouts differ (an object found by one process
    only) compare on what both have.
    """
    found: tuple[tuple[int, int, int], Difference] | None = None
    for rank, ref in sorted(reference.ranks.items()):
        doc = run.ranks.get(rank)
        if doc is None:
            continue
        entries = layout(ref)
        index = {name: i for i, name in enumerate(doc["names"])}
        same_layout = ref["names"] == doc["names"]
        for step in sorted(set(ref["steps"]) & set(doc["steps"]), key=int):
            a, b = ref["steps"][step], doc["steps"][step]
            if a == b and same_layout:
                continue
            differing = [(_PRIORITY.get(e.kind, 2), i) for i, e in enumerate(entries)
                         if (kinds is None or e.kind in kinds) and i < len(a)
                         and index.get(e.name, len(b)) < len(b) and a[i] != b[index[e.name]]]
            if differing:
                priority, i = min(differing)
                key = (int(step), priority, rank)
                if found is None or key < found[0]:
                    e = entries[i]
                    found = (key, Difference(int(step), rank, e.name, e.kind, e.owner))
                break
    return found[1] if found is not None else None


@dataclass(frozen=True)
class StepShape:
    """How many times a step reached the fault points that come several times a step: its
    gradient all-reduces (one per backward pass per wrapped model) and optimizer updates."""

    allreduces: int
    updates: int


def step_shape(reference: Trace, step: int, rank: int) -> StepShape | None:
    """The shape of ``step`` in the fault-free run, as ``rank`` saw it (rank 0's if ``rank`` has
    none); None when the trace has no point counts for it."""
    for r in (rank, 0):
        points = reference.ranks.get(r, {}).get("points", {}).get(str(step))
        if points is not None:
            return StepShape(int(points.get("allreduce", 0)), int(points.get("optimizer", 0)))
    return None


#: At most this many faulted runs per kind of point in one step (an LBFGS step's closure may run
#: 20 backward passes): spread from the first to the last (:func:`spread`).
MAX_PER_POINT = 6


def spread(first: int, last: int, most: int = MAX_PER_POINT) -> list[int]:
    """``first..last`` when it has at most ``most`` values, else ``most`` of them spread evenly,
    ``first`` and ``last`` included (``spread(2, 20, 4) == [2, 8, 14, 20]``)."""
    if last - first + 1 <= most:
        return list(range(first, last + 1))
    if most <= 1:
        return [first][:most]
    return sorted({first + round(i * (last - first) / (most - 1)) for i in range(most)})


def _nth_scenarios(shape: StepShape | None, step: int, victim: int, where: str) -> list[Scenario]:
    """A kill at each all-reduce after the first and at each optimizer update of ``step`` (at most
    :data:`MAX_PER_POINT` of each); none when the step has one of each (the ``allreduce``
    scenario covers it) or no known shape."""
    if shape is None or (shape.allreduces <= 1 and shape.updates <= 1):
        return []
    out = [Scenario(f"a kill in all-reduce {k} of {shape.allreduces} of step {step}{where} (the survivors compute it "
                    "again)", f"rank={victim},step={step},point=allreduce,nth={k},kind=kill", step, "backward")
           for k in spread(2, shape.allreduces)]
    out += [Scenario(f"a kill in optimizer update {k} of {shape.updates} of step {step}{where}",
                     f"rank={victim},step={step},point=optimizer,nth={k},kind=kill", step, "update")
            for k in spread(1, shape.updates)]
    return out


def choose_scenarios(reference: Trace, world: int) -> list[Scenario]:
    """The faulted runs for a script whose fault-free run gave ``reference`` (rank 0's trace: its
    committed steps, epochs and sections; the killed rank's point counts: the step's shape); the
    last rank is the one killed."""
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
        out += _nth_scenarios(step_shape(reference, mid, victim), mid, victim, ", mid-epoch")
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
            if kind == "allreduce":
                out += _nth_scenarios(step_shape(reference, step, victim), step, victim, "")
    sections = [s for s in doc.get("sections", []) if 0 <= int(s["committed"]) < last_step]
    if sections:
        pick = sections[len(sections) // 2]
        out.append(Scenario(f"a kill inside ft.section({pick['name']!r}) after step {pick['committed']}",
                            f"rank={victim},step={pick['committed']},point=section,kind=kill", int(pick["committed"]),
                            "section"))
    return out


def explain(diff: Difference | None, divergences: list[dict[str, Any]], scenario: Scenario, reference: Trace,
            unregistered: Difference | None = None) -> str:
    """The likely cause of a difference, in words, from where it appears and what the run saw.

    Args:
        diff: the first difference (:func:`first_difference`), or None (the traces agree).
        divergences: the run's ``divergence`` events (:meth:`Trace.divergences`).
        scenario: the faulted run.
        reference: the fault-free run's traces.
        unregistered: the first difference in an unregistered object, when it comes later than
            ``diff`` (named at the end: it may be the cause, or follow from it).
    """
    if diff is not None and diff.kind in UNREGISTERED:
        return _unregistered_cause(diff, divergences)
    cause = _registered_cause(diff, divergences, scenario, reference)
    if unregistered is not None and unregistered != diff:
        cause += (f". Also: {unregistered.owner}, not registered with ftrun, differs from step {unregistered.step} "
                  f"(rank {unregistered.rank}): {_registration_hint(unregistered)}")
    return cause


def _registered_cause(diff: Difference | None, divergences: list[dict[str, Any]], scenario: Scenario,
                      reference: Trace) -> str:
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
    if diff.kind == BUFFER:
        return _buffer_cause(diff, scenario, reference)
    epochs = [int(e["first_step"]) for e in reference.ranks[0].get("epochs", [])]
    later = [s for s in epochs if scenario.step < s <= diff.step]
    where = f" (from step {diff.step}, after the epoch boundary at step {later[-1]})" if later else ""
    return ("the gradients computed again were the same (no check saw a difference), but the updates are not: what the optimizer step or its "
            "hyperparameters depend on lives outside the registered state on the new rank -- a learning rate or "
            "another value in a module-level variable, a scheduler not registered, a best-so-far value or a plateau "
            f"or early-stopping counter that decides an annealing at an epoch's end{where}. Register it as replica "
            "state: ft.register(name, obj) with state_dict()/load_state_dict()")


def _registration_hint(diff: Difference) -> str:
    short = (re.findall(r"\w+", diff.owner) or ["state"])[-1]
    if diff.kind == UNREGISTERED_MODULE:
        how = f"{diff.owner} = ft.wrap_model({diff.owner}, name=\"{short}\")"
    else:
        how = f"{diff.owner} = ft.wrap_optimizer({diff.owner}, name=\"{short}\")"
    return (f"a respawned rank does not get it from a replica, and a retried step does not roll it back. Register "
            f"it: {how} (each registered object needs a name of its own: the defaults are \"model\" and "
            "\"optimizer\")")


def _unregistered_cause(diff: Difference, divergences: list[dict[str, Any]]) -> str:
    what = "a module" if diff.kind == UNREGISTERED_MODULE else "an optimizer"
    cause = (f"{diff.owner} ({what}) is not registered with ftrun (ft.wrap_model / ft.wrap_optimizer / "
             f"ft.register): {_registration_hint(diff)}")
    gradient = [d for d in divergences if d["check"] == "gradient"]
    if gradient:
        d = gradient[0]
        cause += (f". The other signs (rank {d['rank']} computed step {d['step']} again and got another local "
                  f"gradient) follow from it")
    return cause


def _buffer_cause(diff: Difference, scenario: Scenario, reference: Trace) -> str:
    statistic = diff.tensor.rsplit(".", 1)[-1] in _BATCHNORM_BUFFERS
    what = (f"buffer {diff.tensor} (a BatchNorm statistic: every forward pass in train mode updates it)" if statistic
            else f"buffer {diff.tensor}")
    eval_mode = ("Run forward passes outside the training step (an evaluation, a section) in eval mode "
                 "(model.eval(), then model.train())")
    if scenario.kind in ("allreduce", "backward", "update") and diff.step == scenario.step:
        return (f"{what} changed outside what ftrun rolls back: the survivors computed step {scenario.step} again, "
                "and its first try's forward passes had updated it already")
    if _rank_local(reference, diff):
        return (f"{what} is each rank's own (the ranks' copies differ in the fault-free run), and rank {diff.rank}'s "
                "replacement did not end with its predecessor's: it came from a replica with the model, or changed "
                "after the predecessor's last record (a forward pass in train mode outside a step). Make the buffers "
                "the same on every rank (ft.wrap_model(model, ddp=True) broadcasts rank 0's before each forward "
                f"pass, as DDP's broadcast_buffers does). {eval_mode}")
    return (f"{what} changed where ftrun neither rolls it back nor records it: a forward pass in train mode outside "
            f"a step (an evaluation, a section, an epoch's end or start) on the survivors or the new rank. {eval_mode}")


def _rank_local(reference: Trace, diff: Difference) -> bool:
    """Whether ``diff``'s tensor differs between ranks in the fault-free run at ``diff.step``."""
    seen = set()
    for doc in reference.ranks.values():
        fingerprints = doc["steps"].get(str(diff.step))
        if fingerprints is None or diff.tensor not in doc["names"]:
            continue
        i = doc["names"].index(diff.tensor)
        if i < len(fingerprints):
            seen.add(fingerprints[i])
    return len(seen) > 1


def _run(script: str, args: list[str], world: int, workdir: Path, fault: str | None, timeout: float) -> tuple[int, str, Path]:
    trace_dir = workdir / "trace"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    env["FTRUN_CHECK_TRACE"] = str(trace_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["FTRUN_FAULT"] = fault
    cmd = ftrun_module_argv("ftrun", ["--worker_num", str(world), "--master_port", "0", "--plain",
                                      "--log_dir", str(workdir / "logs"), "--tail_worker_log", "", "--max_restarts", "3",
                                      "--checkpoint_dir", str(workdir / "checkpoints"), "--resume", "none",
                                      "--on_divergence", "warn", script, *args])  # the installed ftrun, whatever the cwd holds
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, trace_dir
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out, trace_dir


def _judge(scenario: Scenario, code: int, out: str, reference: Trace, run: Trace, say: Callable[[str], None]) -> bool:
    """Compare one faulted run (its exit code, output and traces) with the fault-free one and say
    so (an ``ok`` line, or ``FAIL`` with where and the likely cause); True if it is exactly-once."""
    if code != 0:
        say(f"  FAIL  {scenario.name}: the job failed (exit code {code}); its output ends:")
        for line in out.strip().splitlines()[-8:]:
            say("          " + line)
        return False
    diff = first_difference(reference, run)
    divergences = run.divergences()
    if diff is None and not divergences:
        say(f"  ok    {scenario.name}: bitwise equal")
        return True
    where = (f"first differs after step {diff.step} (rank {diff.rank}), {diff.describe()}"
             if diff is not None else "the parameters and buffers end equal, but a divergence was detected")
    later = first_difference(reference, run, kinds=UNREGISTERED) if diff is not None else None
    say(f"  FAIL  {scenario.name}: {where}")
    say(f"        likely cause: {explain(diff, divergences, scenario, reference, later)}")
    return False


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
        found = reference.unregistered()
        if not any(e.kind == PARAMETER for e in layout(reference.ranks[0])) or not reference.ranks[0]["steps"]:
            unknown = f" (not registered: {', '.join(found)})" if found else ""
            say(f"ftrun check: the script registers no model (ft.wrap_model) or commits no step{unknown}: nothing to "
                "compare")
            return 2
        if found:
            say("  note  not registered with ftrun, so not restored on a respawned rank nor rolled back on a retried "
                f"step: {', '.join(f'{n} (an {k})' if k[0] in 'aeiou' else f'{n} (a {k})' for n, k in found.items())}; "
                "compared in every run")
        scenarios = [s for s in choose_scenarios(reference, world) if only is None or s.kind in only]
        if only is not None and only & {"backward", "update"} and not reference.ranks[0].get("points"):
            say("  note  the trace has no point counts (this ftrun's worker does not record them): no backward or "
                "update scenario")
        failures = 0
        for i, scenario in enumerate(scenarios):
            code, out, trace_dir = _run(script, args, world, root / f"fault{i}", scenario.fault, timeout)
            failures += not _judge(scenario, code, out, reference, Trace.load(trace_dir), say)
        if failures:
            say(f"ftrun check: NOT exactly-once: {failures} of {len(scenarios)} faulted run(s) differ from the fault-free "
                "run (docs/porting.md)")
            return 1
        say(f"ftrun check: exactly-once: {len(scenarios)} faulted run(s) end bitwise equal to the fault-free run")
        return 0
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)

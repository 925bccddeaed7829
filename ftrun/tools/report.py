"""A job's record read back: faults and recoveries on a timeline, their cost, goodput, checkpoints.

Sources, all in ``LOG_DIR``:

- ``events.jsonl``: the coordinator's events (schema in :mod:`ftrun.common.events`). A log directory reused by
  several runs holds them one after the other; each run begins with ``job_started``.
- ``progress.jsonl``: every rank's step over time, sampled by :class:`ProgressRecorder` in the
  coordinator's process (one JSON object a line: ``time``, ``attempt``, ``steps``, a list with one
  step or null per rank), at most every :data:`MIN_SAMPLE_PERIOD_S` seconds and further apart as the
  job grows old, so the file stays small on a job of weeks.

**Goodput** is the share of the job's wall time spent on steps that count:

    goodput = (W - U) / W

where W is the wall time, from ``job_started`` to ``job_finished`` (or now, while the job runs), and
U is the measure of the union of the non-productive intervals:

- *start-up*: from ``job_started`` to the first step any rank begins (imports, rendezvous, the first
  broadcast);
- for each *fault*, from its evidence (a rank's death as the kernel reported it, a hung rank's last
  heartbeat or progress, a failed collective) until training is back where it was:

  - repaired by respawning the failed rank (ARF) or in place (HCCE, UCE): until ``recovery_finished``.
    Nothing is recomputed: training resumes at the first step not committed by every replica;
  - repaired by a whole-job restart: until the new attempt has begun again the step the job had
    reached when the fault struck, so the restart itself and every recomputed step count as lost;
  - not repaired (the job failed, or was stopped during the recovery): until the job's end.

Time is a Unix timestamp in seconds throughout; steps are the training loop's indices. The step
record comes from samples, so start-up and a restart's end are known to the sampling period (0.5 s
at first). A job that reports no steps (a script without the worker library) has no goodput.

Everything here is pure: the same :class:`JobTimeline` is fed by ``ftrun report`` and ``ftrun status``
(from the files), by the console (from the events and status snapshots it is pushed) and by the
Prometheus metrics (from the coordinator's event observer), so the figure is computed in one place.
``matplotlib`` is imported only by :func:`plot_timeline`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ftrun.common.events import AppendLog

log = logging.getLogger("ftrun.tools.report")

EVENTS_FILE = "events.jsonl"
PROGRESS_FILE = "progress.jsonl"
STATUS_FILE = "status.json"

#: Shortest time between two progress samples (seconds).
MIN_SAMPLE_PERIOD_S = 0.5
#: The sampling period grows to (job age / this), so a job records a few thousand samples per
#: doubling of its age at most.
SAMPLES_PER_AGE = 2000
#: A rank whose step time is at least this multiple of the median of the other ranks' is a straggler.
STRAGGLER_FACTOR = 1.5
#: ... and at least this many seconds slower than that median (no noise on 1 ms steps).
STRAGGLER_MIN_GAP_S = 0.002

#: Event kinds shown on the report's timeline (the others are per-rank detail).
TIMELINE_KINDS = frozenset({
    "job_started", "warning", "rank_failed", "rank_hung", "job_restarting", "recovery_started",
    "recovery_fallback", "recovery_finished", "checkpoint_saved", "resumed", "stop_requested",
    "node_lost", "node_joined", "standby_node_joined", "standby_node_left", "job_shrunk", "job_grown", "job_finished", "divergence",
})


class ReportError(Exception):
    """A user-caused problem reading a log directory (missing, empty, unreadable); one line."""


# --------------------------------------------------------------------------- reading the files


def read_jsonl(path: Path, required: Sequence[str] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a JSON-lines file, keeping what can be read and describing every line that cannot.

    Args:
        path: the file.
        required: keys each object must have (a line without one is skipped, with a problem).

    Returns:
        (objects in file order, problems): each problem one line such as
        ``"events.jsonl line 17: not JSON; skipped"``.

    Raises:
        ReportError: the file cannot be read at all.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ReportError(f"cannot read {path}: {err.strerror or err}") from None
    objects: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = data.split(b"\n")
    last = len(lines) - 1
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path.name} line {number}"
        truncated = number - 1 == last  # no end of line: the writer stopped mid-line
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problems.append(f"{where}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); skipped")
            continue
        try:
            obj = json.loads(text)
        except ValueError:
            problems.append(f"{where}: " + ("truncated (the file ends mid-line)" if truncated else "not JSON") + "; skipped")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{where}: a JSON {type(obj).__name__}, not an object; skipped")
            continue
        missing = [key for key in required if key not in obj]
        if missing:
            problems.append(f"{where}: no {', '.join(repr(k) for k in missing)}; skipped")
            continue
        objects.append(obj)
    return objects, problems


def read_events(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The events of ``events.jsonl`` that are usable, and a problem line for each one that is not.

    An event needs a numeric ``time`` and a string ``kind``; ``detail`` must be an object when
    present (else it is replaced by an empty one, with a problem).

    Raises:
        ReportError: the file cannot be read.
    """
    objects, problems = read_jsonl(path, required=("time", "kind"))
    events = []
    for obj in objects:
        t = obj.get("time")
        if not _is_number(t) or not isinstance(obj.get("kind"), str):
            problems.append(f"{path.name}: an event with time={t!r} kind={obj.get('kind')!r} is malformed; skipped")
            continue
        if not isinstance(obj.get("detail", {}), dict):
            problems.append(f"{path.name}: the {obj['kind']} event at {t} has a detail that is not an object; ignored")
            obj = {**obj, "detail": {}}
        events.append(obj)
    return events, problems


@dataclass(frozen=True)
class Sample:
    """Every rank's step at one time.

    Attributes:
        time: Unix time, seconds.
        attempt: the whole-job attempt the steps belong to.
        steps: per rank (index = rank), the step it is running, or None (not started, respawning).
    """

    time: float
    attempt: int
    steps: tuple[int | None, ...]

    @property
    def job_step(self) -> int | None:
        """The job's step: the lowest step a rank runs (None when no rank runs one)."""
        known = [s for s in self.steps if s is not None]
        return min(known) if known else None

    def to_json(self) -> dict[str, Any]:
        """The line written to progress.jsonl."""
        return {"time": round(self.time, 3), "attempt": self.attempt, "steps": list(self.steps)}


def sample_from_status(status: dict[str, Any], now: float | None = None, attempt: int | None = None) -> Sample:
    """A :class:`Sample` of a status snapshot (``status.json``'s object, or the rows alone).

    Args:
        status: a snapshot with ``ranks`` (and ``attempt``, ``updated``).
        now: the sample's time (default: the snapshot's ``updated``, else the current time).
        attempt: overrides the snapshot's attempt.
    """
    rows = status.get("ranks") or []
    steps: list[int | None] = []
    for row in sorted(rows, key=lambda r: r.get("rank", 0)):
        step = row.get("step")
        steps.append(step if isinstance(step, int) and not isinstance(step, bool) else None)
    when = now if now is not None else status.get("updated")
    return Sample(
        time=float(when) if _is_number(when) else time.time(),
        attempt=int(attempt if attempt is not None else status.get("attempt") or 0),
        steps=tuple(steps),
    )


def read_progress(path: Path) -> tuple[list[Sample], list[str]]:
    """The samples of ``progress.jsonl`` (none when the file is missing), with problem lines."""
    if not path.exists():
        return [], []
    objects, problems = read_jsonl(path, required=("time", "steps"))
    samples = []
    for obj in objects:
        steps = obj.get("steps")
        if not _is_number(obj["time"]) or not isinstance(steps, list):
            problems.append(f"{path.name}: a sample at time={obj.get('time')!r} is malformed; skipped")
            continue
        samples.append(Sample(float(obj["time"]), int(obj.get("attempt") or 0),
                              tuple(s if isinstance(s, int) and not isinstance(s, bool) else None for s in steps)))
    return samples, problems


def read_status(path: Path) -> dict[str, Any]:
    """``status.json``'s object.

    Raises:
        ReportError: missing, unreadable, or not a status object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"no job status in {path.parent}: {path.name} does not exist (a job writes it once it has "
                          "started; is --log_dir right?)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    try:
        status = json.loads(text)
    except ValueError:
        raise ReportError(f"{path} is not JSON; it is not a status file written by ftrun") from None
    if not isinstance(status, dict) or not isinstance(status.get("ranks"), list) or "state" not in status:
        raise ReportError(f"{path} is not a status file written by ftrun (no 'state' or 'ranks')")
    return status


def split_runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The runs of a log directory used by several jobs: each begins with ``job_started``.

    Events before the first ``job_started`` (a file whose beginning was lost) form a run of their own.
    """
    runs: list[list[dict[str, Any]]] = []
    for event in events:
        if event["kind"] == "job_started" or not runs:
            runs.append([])
        runs[-1].append(event)
    return runs


# --------------------------------------------------------------------------- the timeline


class Repair(str, Enum):
    """How a fault was dealt with."""

    ARF = "respawned"  # the failed rank(s) respawned, state from a replica
    IN_PLACE = "in place"  # HCCE or UCE: every process kept
    RESTART = "job restart"  # every rank stopped and started again (from a checkpoint, if any)
    FAILED = "job failed"  # not repaired: the job ended
    STOPPED = "stopped"  # the job was stopped while it was being repaired
    OPEN = "in progress"  # not over yet


@dataclass
class Fault:
    """One fault and its repair: an interval of lost time.

    Attributes:
        start: Unix time of the evidence (the death, the last heartbeat or progress of a hung rank).
        end: when training was back where it was (None: not yet).
        kind: ``death``, ``hang``, ``comm_error``, ``recoverable_error`` (``recovery_started``'s fault).
        ranks: the failed ranks.
        causes: one line per failed rank (``"rank 1: killed by SIGKILL"``).
        attempt: the attempt it struck.
        step: the step the job had reached (the failed rank's step), when known.
        repair: how it was dealt with.
        resume_step: the step training resumed at (ARF, in place, or a restart from a checkpoint).
        detection_s, node_wait_s, respawn_s, rebuild_s, transfer_s: the recovery's cost split,
            seconds (``recovery_finished``'s detail; respawn is the slowest respawned rank's;
            node_wait, a lost node's ranks waiting for its replacement to join).
        bytes: state transferred to recovering ranks.
        rounds: recovery rounds (a fault during the recovery starts another).
        recomputed: steps recomputed after a whole-job restart.
        note: a line about the repair (a fallback's reason, a restart's reason).
    """

    start: float
    kind: str = "death"
    ranks: list[int] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    attempt: int = 0
    step: int | None = None
    end: float | None = None
    repair: Repair = Repair.OPEN
    resume_step: int | None = None
    detection_s: float | None = None
    node_wait_s: float | None = None
    respawn_s: float | None = None
    rebuild_s: float | None = None
    transfer_s: float | None = None
    bytes: int | None = None
    rounds: int = 1
    recomputed: int | None = None
    note: str = ""
    restart_at: float | None = None  # job_restarting's time
    restart_attempt: int | None = None  # the attempt that repairs it
    restart_started: set[int] = field(default_factory=set)  # ranks started in that attempt

    def lost(self, now: float) -> float:
        """Seconds lost to it so far (to ``now`` while it is open)."""
        return max(0.0, (self.end if self.end is not None else now) - self.start)

    def label(self) -> str:
        """A short name: ``"death of rank 1"``, ``"comm_error"``."""
        who = f" of rank{'s' if len(self.ranks) > 1 else ''} {','.join(map(str, self.ranks))}" if self.ranks else ""
        return f"{self.kind}{who}"

    def split(self) -> str:
        """The cost split in words, or '' when there is none."""
        parts = [(name, value) for name, value in (("detection", self.detection_s), ("waiting for a node", self.node_wait_s),
                                                    ("respawn", self.respawn_s), ("rebuild", self.rebuild_s),
                                                    ("transfer", self.transfer_s))
                 if value is not None]
        return ", ".join(f"{name} {_secs(value)}" for name, value in parts)


@dataclass(frozen=True)
class Checkpoint:
    """A completed checkpoint (``checkpoint_saved``): time, step, bytes, writing seconds, reason, path."""

    time: float
    step: int | None
    bytes: int | None
    seconds: float | None
    reason: str
    path: str


@dataclass(frozen=True)
class Goodput:
    """Goodput at one time (see the module docstring).

    Attributes:
        wall: wall time W, seconds.
        startup: start-up, seconds (to the first step; all of W while no step has begun).
        lost: seconds lost to faults (their union; a fault during start-up counts as start-up).
        faults: the number of faults.
        ratio: (W - start-up - lost) / W, in [0, 1]; None when no step was ever reported or W is 0.
    """

    wall: float
    startup: float
    lost: float
    faults: int
    ratio: float | None

    @property
    def productive(self) -> float:
        """Seconds spent on steps that count."""
        return max(0.0, self.wall - self.startup - self.lost)

    def describe(self) -> str:
        """One line: ``"92.4% (start-up 10.3 s, 1 fault: 3.2 s lost)"``, or why there is none."""
        if self.ratio is None:
            return "n/a (no step reported)"
        fault_text = "no fault" if not self.faults else f"{self.faults} fault{'s' if self.faults > 1 else ''}: {_secs(self.lost)} lost"
        return f"{self.ratio * 100:.1f}% (start-up {_secs(self.startup)}, {fault_text})"


class JobTimeline:
    """One run's faults, recoveries and checkpoints, built event by event (and sample by sample).

    Feed it the run's events in order with :meth:`add` and, interleaved in time, progress samples
    with :meth:`add_sample`; ask :meth:`goodput` at any time. A second ``job_started`` starts over
    (a log directory reused by another run).

    Args:
        keep_samples: keep every sample (for the plot); a live consumer keeps only what it needs.
    """

    def __init__(self, keep_samples: bool = False) -> None:
        self.keep_samples = keep_samples
        self._reset()

    def _reset(self) -> None:
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.first_step_at: float | None = None
        self.exit_code: int | None = None
        self.final_message: str = ""
        self.root_cause: dict[str, Any] | None = None
        self.log_tail: list[str] = []
        self.script: str = ""
        self.args: list[str] = []
        self.world_size: int | None = None
        self.attempt = 0
        self.faults: list[Fault] = []
        self.checkpoints: list[Checkpoint] = []
        self.timeline: list[dict[str, Any]] = []
        self.samples: list[Sample] = []
        self.last_sample: Sample | None = None
        self.stopping = False
        self.resumed: dict[int, int] = {}  # attempt -> the step its checkpoint holds
        self.last_time: float | None = None
        self._hung: set[int] = set()
        self._first_ranks: set[int] = set()
        self._world_from_message: int | None = None

    # -- feeding
    @property
    def open_fault(self) -> Fault | None:
        """The fault being repaired, if any."""
        return self.faults[-1] if self.faults and self.faults[-1].end is None else None

    def add(self, event: dict[str, Any]) -> None:
        """Take one event (an events.jsonl object); unknown kinds and odd details are ignored."""
        kind = event.get("kind")
        t = event.get("time")
        if not isinstance(kind, str) or not _is_number(t):
            return
        t = float(t)
        if kind == "job_started" and self.started_at is not None:
            self._reset()
        detail = event.get("detail") if isinstance(event.get("detail"), dict) else {}
        self.last_time = t if self.last_time is None else max(self.last_time, t)
        if isinstance(event.get("attempt"), int):
            self.attempt = event["attempt"]
        if kind in TIMELINE_KINDS:
            self.timeline.append(event)
        handler = self._handlers.get(kind)
        if handler is not None:
            handler(self, event, detail, t)

    def add_sample(self, sample: Sample) -> None:
        """Take a progress sample: marks the first step and the end of a restart's lost time."""
        if self.keep_samples:
            self.samples.append(sample)
        self.last_sample = sample
        step = sample.job_step
        if step is None:
            return
        if self.first_step_at is None and (self.started_at is None or sample.time >= self.started_at):
            self.first_step_at = sample.time
        fault = self.open_fault
        if (fault is not None and fault.repair == Repair.RESTART and fault.restart_attempt is not None
                and sample.attempt >= fault.restart_attempt and sample.time >= (fault.restart_at or 0.0)):
            if fault.step is None or step >= fault.step:
                self._close(fault, sample.time)

    def _close(self, fault: Fault, t: float) -> None:
        fault.end = max(t, fault.start)
        if fault.repair == Repair.RESTART and fault.step is not None:
            resume = self.resumed.get(fault.restart_attempt or -1, -1) + 1
            fault.resume_step = resume
            fault.recomputed = max(0, fault.step - resume)

    def _fault_for(self, t: float, attempt: int) -> Fault:
        """The open fault, or a new one starting at ``t``."""
        fault = self.open_fault
        if fault is None:
            fault = Fault(start=t, attempt=attempt)
            self.faults.append(fault)
        return fault

    # -- one handler per event kind
    def _on_job_started(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        self.started_at = t
        self.script = str(detail.get("script") or "")
        self.args = [str(a) for a in detail.get("args") or []] if isinstance(detail.get("args"), list) else []
        # "job started: N rank(s), ..." (else the ranks the first attempt starts tell it)
        message = str(event.get("message") or "")
        head = message.split(":", 1)[-1].strip().split(" ", 1)[0]
        self._world_from_message = int(head) if head.isdigit() else None
        self.world_size = self._world_from_message

    def _on_rank_hung(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        if isinstance(event.get("rank"), int):
            self._hung.add(event["rank"])
        fault = self.open_fault
        if fault is not None and event.get("rank") in fault.ranks:
            fault.kind = "hang"

    def _on_rank_failed(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        if self.stopping:
            return  # ranks ended by a stop are not faults
        detection = detail.get("detection_seconds")
        start = t - float(detection) if _is_number(detection) else t
        fault = self._fault_for(start, int(event.get("attempt") or 0))
        fault.start = min(fault.start, start)
        rank = event.get("rank")
        if isinstance(rank, int) and rank not in fault.ranks:
            fault.ranks.append(rank)
            if rank in self._hung:
                fault.kind = "hang"
        cause = detail.get("cause") or f"exit code {detail.get('exit_code')}"
        fault.causes.append(f"rank {rank}: {cause}")
        step = detail.get("step")
        if isinstance(step, int) and fault.repair != Repair.RESTART:
            fault.step = step if fault.step is None else max(fault.step, step)
        if fault.detection_s is None and _is_number(detection):
            fault.detection_s = float(detection)

    def _on_recovery_started(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        fault = self._fault_for(t, int(event.get("attempt") or 0))
        fault_kind = detail.get("fault")
        if isinstance(fault_kind, str) and fault_kind and "round" not in detail:
            fault.kind = "hang" if fault.kind == "hang" and fault_kind == "death" else fault_kind
        failed = detail.get("failed")
        if isinstance(failed, list):
            for rank in failed:
                if isinstance(rank, int) and rank not in fault.ranks:
                    fault.ranks.append(rank)
        fault.repair = Repair.ARF if fault.ranks else Repair.IN_PLACE
        if _is_number(detail.get("round")):
            fault.rounds = max(fault.rounds, int(detail["round"]))
        if not fault.note and isinstance(detail.get("reason"), str):
            fault.note = detail["reason"]

    def _on_recovery_fallback(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        fault = self._fault_for(t, int(event.get("attempt") or 0))
        fault.note = str(event.get("message") or "")

    def _on_recovery_finished(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        fault = self._fault_for(t, int(event.get("attempt") or 0))
        total = detail.get("total_seconds")
        if _is_number(total):
            fault.start = min(fault.start, t - float(total))
        if fault.repair == Repair.OPEN:
            fault.repair = Repair.ARF if fault.ranks else Repair.IN_PLACE
        for name, key in (("respawn_s", "respawn_seconds"), ("node_wait_s", "node_wait_seconds")):
            per_rank = detail.get(key)
            if isinstance(per_rank, dict):
                values = [float(v) for v in per_rank.values() if _is_number(v)]
                setattr(fault, name, max(values) if values else None)
        for name, key in (("detection_s", "detection_seconds"), ("rebuild_s", "rebuild_seconds"),
                          ("transfer_s", "transfer_seconds")):
            if _is_number(detail.get(key)):
                setattr(fault, name, float(detail[key]))
        if _is_number(detail.get("bytes")):
            fault.bytes = int(detail["bytes"])
        if _is_number(detail.get("resume_step")):
            fault.resume_step = int(detail["resume_step"])
        if _is_number(detail.get("rounds")):
            fault.rounds = int(detail["rounds"])
        fault.recomputed = 0
        fault.end = t

    def _on_job_restarting(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        fault = self._fault_for(t, int(event.get("attempt") or 0))
        fault.repair = Repair.RESTART
        fault.restart_at = t
        fault.restart_attempt = int(event.get("attempt") or 0) + 1
        fault.note = str(detail.get("reason") or fault.note)
        if fault.step is None and self.last_sample is not None and self.last_sample.attempt == fault.attempt:
            fault.step = self.last_sample.job_step

    def _on_rank_started(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        if event.get("attempt") == 0 and isinstance(event.get("rank"), int):
            self._first_ranks.add(event["rank"])
            if self._world_from_message is None:
                self.world_size = len(self._first_ranks)
        fault = self.open_fault
        if fault is None or fault.repair != Repair.RESTART or event.get("attempt") != fault.restart_attempt:
            return
        if isinstance(event.get("rank"), int):
            fault.restart_started.add(event["rank"])
        # Without a step to get back to (a script that reports none), the restart is over once
        # every rank of the new attempt has started.
        if fault.step is None and self.world_size and len(fault.restart_started) >= self.world_size:
            self._close(fault, t)

    def _on_resumed(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        if _is_number(detail.get("step")):
            self.resumed[int(event.get("attempt") or 0)] = int(detail["step"])

    def _on_checkpoint_saved(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        self.checkpoints.append(Checkpoint(
            time=t,
            step=int(detail["step"]) if _is_number(detail.get("step")) else None,
            bytes=int(detail["bytes"]) if _is_number(detail.get("bytes")) else None,
            seconds=float(detail["seconds"]) if _is_number(detail.get("seconds")) else None,
            reason=str(detail.get("reason") or ""),
            path=str(detail.get("path") or ""),
        ))

    def _on_stop_requested(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        self.stopping = True

    def _on_job_finished(self, event: dict[str, Any], detail: dict[str, Any], t: float) -> None:
        self.ended_at = t
        code = detail.get("exit_code")
        self.exit_code = int(code) if _is_number(code) else None
        self.final_message = str(event.get("message") or "")
        root = detail.get("root_cause")
        self.root_cause = root if isinstance(root, dict) else None
        tail = detail.get("log_tail")
        self.log_tail = [str(line) for line in tail] if isinstance(tail, list) else []
        fault = self.open_fault
        if fault is not None:
            fault.repair = Repair.STOPPED if self.stopping else (Repair.FAILED if self.exit_code else fault.repair)
            if fault.repair == Repair.OPEN:
                fault.repair = Repair.FAILED
            fault.end = max(t, fault.start)

    # one handler per event kind (the kinds the timeline needs; others only feed the event list)
    _handlers: dict[str, Callable[["JobTimeline", dict[str, Any], dict[str, Any], float], None]] = {
        "job_started": _on_job_started,
        "rank_hung": _on_rank_hung,
        "rank_failed": _on_rank_failed,
        "recovery_started": _on_recovery_started,
        "recovery_fallback": _on_recovery_fallback,
        "recovery_finished": _on_recovery_finished,
        "job_restarting": _on_job_restarting,
        "rank_started": _on_rank_started,
        "resumed": _on_resumed,
        "checkpoint_saved": _on_checkpoint_saved,
        "stop_requested": _on_stop_requested,
        "job_finished": _on_job_finished,
    }

    # -- questions
    def end_time(self, now: float | None = None) -> float:
        """The run's end, or ``now`` (default: the current time) while it runs."""
        if self.ended_at is not None:
            return self.ended_at
        return time.time() if now is None else now

    def goodput(self, now: float | None = None) -> Goodput:
        """Goodput from the run's start to its end or ``now`` (Unix time; default: the current time)."""
        end = self.end_time(now)
        start = self.started_at if self.started_at is not None else (self.last_time or end)
        wall = max(0.0, end - start)
        startup_end = self.first_step_at if self.first_step_at is not None else end
        startup = (start, min(max(startup_end, start), end))
        fault_spans = [(max(f.start, start), min(f.end if f.end is not None else end, end)) for f in self.faults]
        union = _union_length([startup, *fault_spans])
        startup_s = startup[1] - startup[0]
        lost = max(0.0, union - startup_s)
        if self.first_step_at is None or wall <= 0:
            ratio = None
        else:
            ratio = min(1.0, max(0.0, (wall - union) / wall))
        return Goodput(wall=wall, startup=startup_s, lost=lost, faults=len(self.faults), ratio=ratio)


def _union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of intervals (empty or reversed ones count nothing)."""
    total = 0.0
    cur_start: float | None = None
    cur_end = 0.0
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if cur_start is None or a > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def build_timeline(events: Sequence[dict[str, Any]], samples: Sequence[Sample] = (),
                   keep_samples: bool = True) -> JobTimeline:
    """A :class:`JobTimeline` of one run's events and the samples taken during it, fed in time order
    (events first at equal times)."""
    timeline = JobTimeline(keep_samples=keep_samples)
    start = events[0]["time"] if events and events[0]["kind"] == "job_started" else None
    end = next((e["time"] for e in reversed(events) if e["kind"] == "job_finished"), None)
    mine = [s for s in samples if (start is None or s.time >= start - 1.0) and (end is None or s.time <= end + 1.0)]
    merged: list[tuple[float, int, int, Any]] = [(float(e["time"]), 0, i, e) for i, e in enumerate(events)]
    merged += [(s.time, 1, i, s) for i, s in enumerate(mine)]
    for _, is_sample, _, item in sorted(merged, key=lambda x: x[:3]):
        if is_sample:
            timeline.add_sample(item)
        else:
            timeline.add(item)
    return timeline


# --------------------------------------------------------------------------- ranks: progress, stragglers


def job_steps_done(rows: Sequence[dict[str, Any]]) -> int | None:
    """Steps the job has completed, from status rows: the lowest over ranks of the steps each has
    finished (its current step; one more once it succeeded). None when no rank reported a step."""
    done = []
    for row in rows:
        step = row.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            done.append(step + 1 if row.get("state") == "succeeded" else step)
    return min(done) if done else None


def job_total_steps(rows: Sequence[dict[str, Any]]) -> int | None:
    """The number of steps the job runs (the ranks' ``ft.steps(n)``), when a rank said so."""
    totals = [r.get("total_steps") for r in rows if isinstance(r.get("total_steps"), int)]
    return max(totals) if totals else None


def step_seconds(row: dict[str, Any]) -> float | None:
    """The rank's step time for straggler detection: its compute time before the step's collective
    (``compute_seconds``) where the coordinator reports it, else its latest step time."""
    for key in ("compute_seconds", "last_step_seconds"):
        value = row.get(key)
        if _is_number(value) and value >= 0:
            return float(value)
    return None


def stragglers(rows: Sequence[dict[str, Any]], factor: float = STRAGGLER_FACTOR,
               min_gap: float = STRAGGLER_MIN_GAP_S) -> dict[int, float]:
    """Ranks markedly slower than the others.

    A running rank is a straggler when its step time (:func:`step_seconds`) is at least ``factor``
    times the median of the other running ranks' and at least ``min_gap`` seconds more.

    Returns:
        rank -> its step time over that median.
    """
    timed = {r["rank"]: s for r in rows
             if r.get("state") in ("healthy", "recovering") and (s := step_seconds(r)) is not None
             and isinstance(r.get("rank"), int)}
    out: dict[int, float] = {}
    if len(timed) < 2:
        return out
    for rank, seconds in timed.items():
        others = statistics.median(v for k, v in timed.items() if k != rank)
        if others > 0 and seconds >= factor * others and seconds - others >= min_gap:
            out[rank] = seconds / others
    return out


def step_rate(samples: Sequence[Sample], window: float = 30.0) -> float | None:
    """Steps per second of the job over the last ``window`` seconds of samples of one attempt."""
    usable = [s for s in samples if s.job_step is not None]
    if len(usable) < 2:
        return None
    last = usable[-1]
    first = next((s for s in usable if s.attempt == last.attempt and s.time >= last.time - window), None)
    if first is None or last.time <= first.time:
        return None
    return max(0.0, (last.job_step - first.job_step) / (last.time - first.time))  # type: ignore[operator]


# --------------------------------------------------------------------------- recording progress


class ProgressRecorder:
    """Appends every rank's step to ``LOG_DIR/progress.jsonl`` from a background thread.

    It reads the coordinator's ``status.json`` (never the coordinator's objects, so it needs no
    lock), every :data:`MIN_SAMPLE_PERIOD_S` seconds at first and every (age / :data:`SAMPLES_PER_AGE`)
    seconds later, and writes a line only when a step or the attempt changed. The file is started
    afresh by each run. Each sample written is also handed to :attr:`listeners` (the metrics'
    goodput), from the recorder's thread.

    Args:
        log_dir: the job's log directory.
        pid: the coordinator's process id, which its status.json names (default: this process's).
        clock: Unix time in seconds.

    Raises:
        OSError: progress.jsonl cannot be created.
    """

    def __init__(self, log_dir: Path, pid: int | None = None, clock: Callable[[], float] = time.time) -> None:
        self.log_dir = Path(log_dir)
        self.pid = os.getpid() if pid is None else pid
        self.listeners: list[Callable[[Sample], None]] = []  # called with every sample recorded
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[int, tuple[int | None, ...]] | None = None
        self._started = clock()
        # Best-effort (a full or removed log directory costs samples, never the job).
        self._stream = AppendLog(self.log_dir / PROGRESS_FILE, lambda why: log.warning("%s", why), truncate=True)
        self._closed = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start sampling in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="ftrun-progress", daemon=True)
        self._thread.start()

    def period(self, now: float) -> float:
        """Seconds until the next sample."""
        return max(MIN_SAMPLE_PERIOD_S, (now - self._started) / SAMPLES_PER_AGE)

    def sample(self) -> None:
        """Read status.json once and record a sample if anything moved (errors are ignored: the
        file may not exist yet)."""
        try:
            status = json.loads((self.log_dir / STATUS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if not isinstance(status, dict) or status.get("pid") != self.pid:
            return  # not written yet by this job's coordinator (a file of an earlier run)
        sample = sample_from_status(status, now=self.clock())
        key = (sample.attempt, sample.steps)
        with self._lock:
            if key == self._last or self._closed:
                return
            self._last = key
            self._stream.write_line(json.dumps(sample.to_json()))
        for listener in self.listeners:
            listener(sample)

    def _run(self) -> None:
        while not self._stop.wait(self.period(self.clock())):
            self.sample()

    def close(self) -> None:
        """Stop the thread, take a last sample, close the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()
        with self._lock:
            self._closed = True
            self._stream.close()


# --------------------------------------------------------------------------- the report


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _secs(seconds: float | None) -> str:
    """Seconds for people: ``0.012 s``, ``3.20 s``, ``95 s``, ``1:02:03``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds:.3f} s"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 600:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _mb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.2f} MB"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


@dataclass
class Report:
    """What ``ftrun report`` read: the run's timeline, the number of runs in the file, problems."""

    log_dir: Path
    timeline: JobTimeline
    runs: int
    problems: list[str]
    events: int
    samples: int


def load_report(log_dir: Path) -> Report:
    """Read a log directory's last run.

    Raises:
        ReportError: no such directory, no events.jsonl, or no usable event in it.
    """
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise ReportError(f"{log_dir} is not a directory; give the job's --log_dir")
    events_path = log_dir / EVENTS_FILE
    if not events_path.exists():
        raise ReportError(f"no {EVENTS_FILE} in {log_dir}; give the --log_dir of a job that has started")
    events, problems = read_events(events_path)
    if not events:
        raise ReportError(f"{events_path} holds no readable event" + (f" ({len(problems)} bad line(s))" if problems else ""))
    runs = split_runs(events)
    samples, progress_problems = read_progress(log_dir / PROGRESS_FILE)
    last = runs[-1]
    timeline = build_timeline(last, samples)
    return Report(log_dir, timeline, len(runs), problems + progress_problems, len(last), len(timeline.samples))


def _job_start(tl: JobTimeline, otherwise: float) -> float:
    """When the job started: its ``job_started`` event, else its first event, else ``otherwise``."""
    return tl.started_at if tl.started_at is not None else (tl.timeline[0]["time"] if tl.timeline else otherwise)


def format_report(report: Report, now: float | None = None) -> list[str]:
    """The report as lines of text (no colour)."""
    tl = report.timeline
    now = time.time() if now is None else now
    start = _job_start(tl, now)
    end = tl.end_time(now)
    lines = _summary_lines(report, start, end, now)
    lines.append("")
    lines.append("timeline:")
    for ev in tl.timeline:
        offset = float(ev["time"]) - start
        lines.append(f"  {offset:+9.2f} s  {_clock(float(ev['time']))}  {ev['kind']:<18} {str(ev.get('message') or '')}")
    lines.append("")
    lines.extend(_fault_lines(tl, start, end))
    lines.append("")
    lines.extend(_checkpoint_lines(tl, start))
    if tl.exit_code:
        lines.append("")
        lines.extend(_root_cause_lines(tl))
    if report.problems:
        lines.append("")
        lines.append(f"problems reading {report.log_dir}:")
        lines.extend("  " + p for p in report.problems)
    return lines


def _summary_lines(report: Report, start: float, end: float, now: float) -> list[str]:
    """The report's heading, the job's command, span and outcome, and its goodput."""
    tl = report.timeline
    lines = [f"ftrun report of {report.log_dir}" + (f" (the last of {report.runs} runs in this log directory)" if report.runs > 1 else "")]
    command = " ".join([tl.script, *tl.args]).strip() or "?"
    size = f" on {tl.world_size} rank(s)" if tl.world_size else ""
    if tl.ended_at is None:
        state = "still running, or ended without a final event"
    elif tl.exit_code == 0:
        state = "succeeded"
    else:
        state = f"failed (exit code {tl.exit_code})" if tl.exit_code is not None else "ended"
    lines.append(f"job: {command}{size}; {_clock(start)} to {_clock(end)} ({_secs(end - start)}): {state}")
    good = tl.goodput(now)
    if good.ratio is None and report.samples == 0:
        lines.append(f"goodput: n/a (no {PROGRESS_FILE} in the log directory: goodput needs the ranks' step record)")
    else:
        lines.append(f"goodput: {good.describe()}")
    return lines


def _fault_lines(tl: JobTimeline, start: float, end: float) -> list[str]:
    """The faults as a table (times from the job's start), then each one's causes."""
    if not tl.faults:
        return ["faults: none"]
    lines = ["faults (times from the job's start, seconds):"]
    header = ("#", "at", "fault", "repair", "lost", "detect", "node wait", "respawn", "rebuild", "transfer", "moved",
              "resumed at")
    rows = []
    for i, f in enumerate(tl.faults, start=1):
        resumed = "-" if f.resume_step is None else f"step {f.resume_step}"
        if f.recomputed:
            resumed += f" ({f.recomputed} recomputed)"
        rows.append((str(i), f"{f.start - start:+.2f}", f.label(), f.repair.value, f"{f.lost(end):.2f}",
                     _fmt_opt(f.detection_s, 3), _fmt_opt(f.node_wait_s, 2), _fmt_opt(f.respawn_s, 2),
                     _fmt_opt(f.rebuild_s, 2),
                     _fmt_opt(f.transfer_s, 3), _mb(f.bytes), resumed))
    lines.extend("  " + line for line in _columns([header, *rows]))
    for i, f in enumerate(tl.faults, start=1):
        why = "; ".join(f.causes) or f.note
        if why:
            lines.append(f"  {i}: {why}" + (f" (step {f.step})" if f.step is not None else "")
                         + (f"; {f.rounds} recovery rounds" if f.rounds > 1 else ""))
    return lines


def _checkpoint_lines(tl: JobTimeline, start: float) -> list[str]:
    """The checkpoints the run saved, as a table (times from the job's start)."""
    if not tl.checkpoints:
        return ["checkpoints: none"]
    header = ("at", "step", "size", "write", "reason", "path")
    rows = [(f"{c.time - start:+.2f} s", "-" if c.step is None else str(c.step), _mb(c.bytes),
             _secs(c.seconds), c.reason, c.path) for c in tl.checkpoints]
    return ["checkpoints:", *("  " + line for line in _columns([header, *rows]))]


def _root_cause_lines(tl: JobTimeline) -> list[str]:
    """Why a failed job failed: the rank named as the root cause, the final message, its log's tail."""
    root = tl.root_cause or {}
    cause = f"rank {root.get('rank')} ({root.get('cause')})" if root else "not named"
    lines = [f"root cause: {cause}", f"  {tl.final_message}"]
    if tl.log_tail:
        lines.append(f"  last lines of rank {root.get('rank')}'s log:")
        lines.extend("    " + line for line in tl.log_tail)
    return lines


def _fmt_opt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


_FAULT_COLOURS = {"death": "tab:red", "hang": "tab:orange", "comm_error": "tab:purple",
                  "recoverable_error": "tab:olive", "node_loss": "tab:brown"}


def plot_timeline(report: Report, out: Path, now: float | None = None) -> None:
    """Draw the run: step against time per rank (the lowest and highest step over ranks when
    there are more than 16), faults shaded from their evidence to their repair, restarts and
    checkpoints marked. Written as a PNG with matplotlib's Agg backend (imported here only).

    Raises:
        ReportError: matplotlib is not installed, or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install matplotlib (or ftrun[plot])") from None
    tl = report.timeline
    end = tl.end_time(now)
    start = _job_start(tl, end)
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    try:
        _plot_steps(ax, tl.samples, start)
        if tl.first_step_at is not None and tl.first_step_at > start:
            ax.axvspan(0, tl.first_step_at - start, color="grey", alpha=0.12,
                       label=f"start-up ({_secs(tl.first_step_at - start)})")
        _mark_faults(ax, tl.faults, start, end)
        for c in tl.checkpoints:
            ax.axvline(c.time - start, color="tab:green", linestyle=":", linewidth=1.0)
        if tl.checkpoints:
            ax.plot([], [], color="tab:green", linestyle=":", label=f"checkpoint ({len(tl.checkpoints)})")
        ax.set_xlim(0, max(end - start, 1e-3))
        ax.set_xlabel("seconds since the job started")
        ax.set_ylabel("step")
        good = tl.goodput(now)
        ax.set_title(f"{Path(tl.script).name or 'job'}: goodput {good.describe()}", fontsize=10)
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        try:
            fig.savefig(out, format="png")
        except OSError as err:
            raise ReportError(f"cannot write {out}: {err.strerror or err}") from None
    finally:
        plt.close(fig)


def _plot_steps(ax: Any, samples: Sequence[Sample], start: float) -> None:
    """Each rank's step against time (at most 16 ranks; beyond, the band from the lowest step to the
    highest), or a note that the run left no progress record."""
    ranks = max((len(s.steps) for s in samples), default=0)
    xs = [s.time - start for s in samples]
    if ranks and ranks <= 16:
        for rank in range(ranks):
            ys = [s.steps[rank] if rank < len(s.steps) and s.steps[rank] is not None else math.nan for s in samples]
            ax.step(xs, ys, where="post", linewidth=1.2, label=f"rank {rank}")
    elif ranks:
        lo = [min((v for v in s.steps if v is not None), default=math.nan) for s in samples]
        hi = [max((v for v in s.steps if v is not None), default=math.nan) for s in samples]
        ax.fill_between(xs, lo, hi, step="post", alpha=0.4, label=f"step range over {ranks} ranks")
    else:
        ax.text(0.5, 0.5, f"no progress record ({PROGRESS_FILE}) in this log directory",
                transform=ax.transAxes, ha="center", va="center", color="grey")


def _mark_faults(ax: Any, faults: Sequence[Fault], start: float, end: float) -> None:
    """Shade each fault from its first evidence to its repair (numbered, coloured by kind), and mark
    the restart of those repaired by one."""
    for i, f in enumerate(faults, start=1):
        colour = _FAULT_COLOURS.get(f.kind, "tab:red")
        f_end = f.end if f.end is not None else end
        ax.axvspan(f.start - start, f_end - start, color=colour, alpha=0.18,
                   label=f"fault {i}: {f.label()}, {f.repair.value} ({_secs(f.lost(end))} lost)")
        ax.axvline(f.start - start, color=colour, linewidth=1.0)
        ax.annotate(str(i), (f.start - start, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", color=colour, fontsize=9, fontweight="bold")
        if f.restart_at is not None:
            ax.axvline(f.restart_at - start, color=colour, linestyle="--", linewidth=1.0)

"""The rank table: each rank of the job and the process serving it now (its incarnation).

A :class:`Rank` is the job's slot (its global and local rank, its node, its restart count); the
process that serves it is an :class:`Incarnation`, made fresh by each spawn, so nothing of a dead
process (its pid, connection, step, watchdog evidence) can leak into the next one (cf.
torchelastic's ``Worker`` and ``WorkerState``). What a rank's control messages say about its
progress is recorded here (:meth:`Rank.on_heartbeat`, :meth:`Rank.on_step`...); the decisions
those records feed are the watchdog's (:mod:`ftrun.coordinator.watchdog`) and the recovery
rounds' (:mod:`ftrun.coordinator.rounds`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ftrun.coordinator.policy import NO_STATE, RANK_TRANSITIONS, STARTUP_WINDOW_S, RankState, RecoveryPlan
from ftrun.node.spawner import tail_lines

log = logging.getLogger("ftrun.coordinator")


class RankPhase(str, Enum):
    """Where in its step a rank's process is, as its heartbeats' step board says (for the watchdog)."""

    SETUP = "setup"  # started, no step begun yet (imports, the script's set-up, the initial broadcast)
    COMPUTE = "compute"  # between a step's begin (or an update's end) and its collective
    COLLECTIVE = "collective"  # announced the step's gradient all-reduce
    UPDATE = "update"  # in the optimizer update
    RECOVERING = "recovering"  # reported a fault or answered an abort: in a recovery round
    DONE = "done"  # left its step loop (ft.finish() or the end of ft.steps)


_PHASES = {phase.value: phase for phase in RankPhase}


@dataclass
class Incarnation:
    """One process serving a rank, from its spawn to its exit (the fields a respawn starts afresh).

    Times are the coordinator's monotonic clock, seconds.
    """

    number: int = -1
    started_at: float = 0.0
    pid: int | None = None
    running: bool = False
    state: RankState = RankState.STARTING
    identity: bytes | None = None  # its control connection (ZeroMQ routing identity), from its hello
    last_heartbeat: float = 0.0
    direct: int = 0  # frames of it read from its own connection (a relayed beat's order: RankMessages.on_relayed)
    relayed: bool = False  # its node's agent relayed a beat of it: a round's orders go through that agent
    step: int | None = None
    committed: int = NO_STATE
    metrics: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    exit_desc: str = ""
    # the watchdog's evidence
    phase: RankPhase = RankPhase.SETUP
    last_progress: float = 0.0  # start of its latest phase (step board) or its last progress message
    samples: int = 0  # step times observed by this process (its step board)
    steps_ended: bool = False
    kill_reason: str | None = None  # set when ftrun kills it (a hang)
    hung_since: float = 0.0  # the evidence's start (last heartbeat or progress)
    final_step: int | None = None  # the committed step it claimed when it called ft.finish()
    finished: bool = False  # it called ft.finish(): it waits in the finish barrier, then its code after that runs unwatched
    released: bool = False  # told that every rank finished (it leaves the finish barrier)
    in_dist: bool | None = None  # its last heartbeat: training thread inside torch.distributed (None: unknown)
    stage: str = "setup"  # its last heartbeat: where in ftrun's flow (ftrun.rank.recovery.RankProgress.stage)
    stage_bytes: int = 0  # the bytes that stage moves (a transfer's state)
    rejoin_by: float | None = None  # after a takeover: it says hello to the new coordinator by then, or is hung
    outside_since: float | None = None  # first heartbeat of this stage seeing it outside torch.distributed
    section: str | None = None  # a named section it is in (evaluation, checkpoint writing): ft.section()
    section_timeout: float | None = None  # that section's own bound, seconds (None: unbounded)
    section_started: float = 0.0
    section_closed_at: float = 0.0  # when its last section closed (step times across it are not samples)

    def move(self, state: RankState) -> bool:
        """Move to ``state`` if :data:`~ftrun.coordinator.policy.RANK_TRANSITIONS` allows it from
        the current one; a move it does not allow (news of a process that has already exited or is
        being stopped, read late) leaves the state as it is, is logged, and returns False."""
        if state not in RANK_TRANSITIONS[self.state]:
            log.warning("incarnation %d (pid %s): no move from %s to %s; it stays %s",
                        self.number, self.pid, self.state.value, state.value, self.state.value)
            return False
        self.state = state
        return True


@dataclass
class Rank:
    """One rank of the job (cf. torchelastic's Worker) and its current process, :attr:`proc`.

    The process runs on node ``node`` and is owned by that node's agent; the coordinator knows it
    through the agent's reports: ``proc.running`` from the spawn until its exit is reported,
    ``proc.pid`` once the agent (or the rank's hello) has told it.
    """

    rank: int
    local_rank: int
    node: int = 0
    proc: Incarnation = field(default_factory=Incarnation)
    restarts: int = 0
    library: bool = False  # said hello through the worker library (kept across its incarnations)
    replica_group: tuple[int, ...] = ()
    rollback_ok: bool = True  # its loop can roll back in place to a checkpoint (its fault reports say; ft.steps)
    total_steps: int | None = None  # the number of steps its loop runs (ft.steps(n)), when known
    last_step_seconds: float | None = None  # its latest step time (for stragglers)
    compute_seconds: float | None = None  # its latest step's start to its collective (its own work)
    previous: Incarnation | None = None  # the incarnation before this one (its late reports, see Messages.handle)

    @property
    def incarnation(self) -> int:
        """The number of the process serving it now (0 for the first; -1 before any spawn)."""
        return self.proc.number

    def respawned(self, now: float) -> Incarnation:
        """Start its next incarnation (a fresh record, running from ``now``) and return it."""
        self.previous = self.proc
        self.proc = Incarnation(number=self.proc.number + 1, started_at=now, running=True)
        return self.proc

    def alive(self) -> bool:
        return self.proc.running

    def started_up(self, now: float) -> bool:
        """Past its start-up: it said hello through the worker library, exited 0, or has run for
        :data:`~ftrun.coordinator.policy.STARTUP_WINDOW_S` (a failure then is no start-up failure)."""
        return (self.library or self.proc.state == RankState.SUCCEEDED
                or now - self.proc.started_at > STARTUP_WINDOW_S)

    def connected(self) -> bool:
        """Alive, said hello, and not being killed by ftrun: a rank the coordinator talks to."""
        return self.proc.running and self.proc.identity is not None and self.proc.kill_reason is None

    def status(self, now: float) -> dict[str, Any]:
        p = self.proc
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": p.pid,
            "state": p.state.value,
            "step": p.step,
            "metrics": p.metrics,
            "restarts": self.restarts,
            "incarnation": p.number,
            "node": self.node,
            "total_steps": self.total_steps,
            "last_step_seconds": self.last_step_seconds,
            "compute_seconds": self.compute_seconds,
            "uptime": (now - p.started_at) if p.running else None,
            "exit": p.exit_desc or None,
        }

    # ---------------------------------------------------------- what its messages say
    def on_heartbeat(self, in_dist: Any, stage: Any, stage_bytes: Any, now: float) -> None:
        """The heartbeat thread's evidence: whether the training thread waits inside a
        torch.distributed call, and in which stage of ftrun's flow (with the bytes it moves)."""
        p = self.proc
        p.in_dist = in_dist if type(in_dist) is bool else None
        if type(stage) is str or isinstance(stage, str):  # a row a rank a second: the exact type first
            stage = stage[:20]
            if p.in_dist is not False:
                p.outside_since = None
            elif p.outside_since is None or stage != p.stage:
                p.outside_since = now
            p.stage = stage
            p.stage_bytes = stage_bytes if type(stage_bytes) is int and stage_bytes > 0 else 0

    def on_board(self, board: dict[str, Any], now: float, warmup_steps: int) -> tuple[bool, float | None]:
        """A heartbeat's step board (:class:`ftrun.rank.client.StepBoard`): its step, committed step and
        phase, with the phase's age; the watchdog counts progress from the phase's start. Returns
        (whether its step moved, the largest of its new step times that are samples for the
        automatic step timeout: past ``warmup_steps`` samples of this process, else None). Once the rank
        left its step loop (``steps_end``, ``done``) a late board changes nothing.

        A board a rank a second (16,384 a second through the relay at 16,384 ranks): the values'
        types are looked at exactly (as msgpack decodes them), the optional ones only when sent."""
        p = self.proc
        get = board.get
        value = get("phase")
        phase = _PHASES.get(value) if type(value) is str else None  # one look-up
        if phase is None or p.steps_ended:
            return False, None
        moved = False
        value = get("step")
        if type(value) is int and value != p.step:
            p.step, moved = value, True
        value = get("committed")
        if type(value) is int:
            p.committed = value
        value = get("total")
        if value is not None and type(value) is int:
            self.total_steps = value
        value = get("last_step")
        if value is not None and is_seconds(value):
            self.last_step_seconds = float(value)
        value = get("compute")
        if value is not None and is_seconds(value):
            self.compute_seconds = float(value)
        if phase is not RankPhase.SETUP:
            p.phase = phase
            value = get("phase_age")
            if is_seconds(value) and now - value > p.last_progress:
                p.last_progress = now - value
        samples, times = get("samples"), get("step_times")
        if type(samples) is not int or type(times) is not list:
            return moved, None
        p.samples = samples
        # the listed times are numbered samples - len + 1 .. samples
        first_listed = samples - len(times) + 1
        past = [float(t) for t in (times if first_listed > warmup_steps else times[warmup_steps + 1 - first_listed:])
                if is_seconds(t)]
        first, older = get("step_max_from"), get("step_max")
        if is_int(first) and first > warmup_steps and is_seconds(older):
            past.append(float(older))
        return moved, max(past, default=None)

    def on_progress(self, step: int, metrics: dict[Any, Any], now: float) -> None:
        """``ft.report()``: its step and metrics (numbers and short texts only)."""
        p = self.proc
        p.step, p.last_progress = step, now
        p.metrics = {str(k): v for k, v in metrics.items() if isinstance(v, (int, float, str))}

    def on_section(self, name: Any, timeout: Any, now: float) -> None:
        """It opens, keeps or closes a named section (``ft.section()``: an evaluation, a checkpoint
        write) whose own bound replaces the step watchdog's while it is open (NVRx's sections)."""
        p = self.proc
        if isinstance(name, str) and name:
            if p.section != name:
                p.section, p.section_started = name[:100], now
            p.section_timeout = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0 else None
        elif name is None and p.section is not None:
            p.section, p.section_timeout, p.section_closed_at = None, None, now

    def on_steps_end(self) -> None:
        """It left its step loop: no step watchdog for it from here on."""
        self.proc.steps_ended, self.proc.phase = True, RankPhase.DONE


def is_int(value: Any) -> bool:
    """An int that is no bool (as msgpack decodes a message's integers: exactly ``int``)."""
    return type(value) is int


def is_seconds(value: Any) -> bool:
    """A duration in seconds, as a message carries it: a number (exactly ``int`` or ``float``: no
    bool), in [0, 1e9) (no NaN)."""
    kind = type(value)
    return (kind is float or kind is int) and 0 <= value < 1e9


@dataclass
class Failure:
    """A rank's failure, kept for the final summary (root cause = the first of the last round)."""

    rank: int
    pid: int | None
    exit_code: int
    description: str
    time: float
    detection_seconds: float = 0.0  # from the evidence (SIGCHLD, last heartbeat) to detection
    log_tail: tuple[str, ...] = ()  # the end of that incarnation's log (an error code or a crash)


def first_failure_tail(failures: list[Failure], rank: int, log_dir: Path) -> tuple[list[str], str]:
    """The end of the log of ``rank``'s first failed incarnation (its first traceback, not a later
    incarnation's warnings), and a note when every incarnation of it failed the same way (the
    same last line: a script error no respawn can repair)."""
    mine = [f for f in failures if f.rank == rank]
    tails = [f.log_tail for f in mine if f.log_tail]
    if not tails:
        return tail_lines(log_dir / f"worker_{rank}.log", 20), ""
    same = ""
    if len(mine) > 1 and len(tails) == len(mine) and len({tail[-1].strip() for tail in tails}) == 1:
        same = f"; each of its {len(mine)} incarnations failed the same way ({tails[0][-1].strip()[:200]})"
    return list(tails[0]), same


@dataclass
class RecoveryRound:
    """An ARF reconfiguration in progress (one generation; a new fault starts the next)."""

    generation: int
    started_at: float  # the first failure of this recovery (kept across restarted rounds)
    failed: set[int]
    detection_seconds: float = 0.0  # of the failure that started it
    reports: dict[int, int] = field(default_factory=dict)  # rank -> committed step
    plan: RecoveryPlan | None = None
    planned_at: float = 0.0
    recovered: dict[int, dict[str, Any]] = field(default_factory=dict)
    respawned_at: dict[int, float] = field(default_factory=dict)
    joined_at: dict[int, float] = field(default_factory=dict)
    rounds: int = 1
    round_started: float = 0.0  # when the current round began (its deadlines count from here)
    # The live ranks that had not reported (not carried out the plan) at the last look over every
    # rank; None: not looked yet (RecoveryRounds.plan_when_reported, finish_when_recovered).
    unreported: set[int] | None = None
    unrecovered: set[int] | None = None



"""The job coordinator: one per job, on node 0, where every job-wide decision is made.

It runs in node 0's supervisor process (``python -m ftrun.supervisor``, a child of the launcher),
beside node 0's agent (:class:`~ftrun.agent.LocalAgent`); every other node's agent connects to it
over the authenticated control plane, and so does every rank of every node. It:

- has each node's agent spawn that node's ranks, with torchrun's and msrun's environment contract
  (:meth:`Coordinator.rank_vars`), and learns of every exit from the agents' reports (an agent is
  its ranks' parent and sees a death at once, by ``SIGCHLD``);
- binds the ZeroMQ ROUTER that ranks and agents talk to (hello, heartbeat, step, update, fault...;
  agent hello, beat, spawned, exited, stacks); frames that do not verify, or that do not match a
  live rank's or agent's connection, are dropped and counted (:mod:`ftrun.protocol`);
- applies :mod:`ftrun.policy`: respawn only the failed rank and orchestrate the state transfer
  across nodes (ARF), restart the whole job on every node (torchrun semantics), or fail with the
  root cause's exit code;
- watches for hangs (the watchdog): a rank whose heartbeats stop (frozen), a job whose steps stop
  advancing (a deadlock, an endless loop, a stuck collective), a rank that never reaches its first
  step; it has the rank's agent dump its Python stacks (faulthandler) and kill it, and recovers as
  for a death; a collective stuck on every rank is rebuilt (HCCE);
- repairs in place, without a respawn, a communication error (HCCE) or a recoverable error (UCE)
  that a rank reports;
- keeps the training state when it cannot repair (TTP): before a whole-job restart, a failure with
  the budget used up, a lost node, or a stop by SIGTERM/SIGINT, it has one live replica of each
  shard write the newest step every shard committed (a *dying-gasp* checkpoint), completes periodic
  checkpoints (``--save_steps``) with their manifest, and starts every attempt from the newest
  complete checkpoint (``--resume``);
- hosts a fresh c10d ``TCPStore`` for every whole-job attempt (so a restarted job never meets a
  previous attempt's keys; the ranks' process groups rendezvous on it);
- beats to every agent and declares a node lost when its agent falls silent;
- records every event in ``LOG_DIR/events.jsonl`` and pushes events and status snapshots to the
  launcher, which draws the console.

Its exit code is the job's: 0, the root-cause rank's exit code (128+N for signal N), or 130/143 when
stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from . import checkpoint as ckpt
from . import procs
from .agent import AgentHandle, RemoteAgent, SpareNote, Spawned, Stacks
from .config import JobSpec
from .events import Event, EventKind, EventLog
from .policy import (
    NO_STATE,
    Action,
    NoLiveReplica,
    RankState,
    RecoveryPlan,
    decide_on_failure,
    default_replica_groups,
    plan_recovery,
    replica_groups_from_hello,
)
from .protocol import CONTROL, MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Receiver, Sender, decode, encode, events_for, to_peer
from .spawner import SPARE_MODE_VAR, ExitReport, StopReport, shared_dir_marker, tail_lines

log = logging.getLogger("ftrun.coordinator")

STATUS_PERIOD_S = 0.25  # at most four console snapshots a second
REPORT_DEADLINE_S = 10.0  # a survivor answers an abort in milliseconds; after this it is hung
PLAN_DEADLINE_S = 60.0  # to build the new group and move the state, unless waiting in torch.distributed
UNREPAIRED_GRACE_S = 1.0  # wait this long for a death to explain a failed collective before restarting
TTP_REPORT_WAIT_S = 10.0  # how long live ranks get to reach a safe point and report (dying gasp)
TTP_WRITE_WAIT_S = 300.0  # how long the shard writers get to write (dying gasp)
AGENT_MESSAGES = frozenset({MsgType.AGENT_HELLO, MsgType.AGENT_BEAT, MsgType.SPAWNED, MsgType.EXITED, MsgType.STOPPED,
                            MsgType.STACKS, MsgType.SPARE_NOTE})
_KIND_LABEL = {"comm_error": "HCCE: communication error", "recoverable_error": "UCE: recoverable error"}
MAX_REJECT_EVENTS = 20  # rejected frames after this many are counted in the log only
OFFENDER_REJECTS = 8  # a connection that sent this many rejected frames is not read any more
READ_BUDGET = 2000  # frames handled per pass of the main loop (then deaths and hangs are checked)
# A rank that ends with one of these after every other rank exited 0 crashed in its teardown (an
# abort or a segfault in a destructor): the job is not restarted for it (Coordinator.on_failure).
TEARDOWN_CRASH_CODES = frozenset({128 + signal.SIGABRT, 128 + signal.SIGSEGV})
STALL_BASE_S = 5.0  # a rank outside torch.distributed this long during a watched stage, peers waiting, is hung
STALL_MIN_BYTES_PER_S = 50e6  # ...plus the stage's bytes at this rate (copying state runs at GB/s)
STALL_STAGES = {"recover": "the recovery's drop of its group", "transfer": "the state transfer",
                "init": "the initial broadcast"}  # watched stages (ftrun.recovery.RankProgress.stage)
STOP_REPORT_WAIT_S = 10.0  # past the grace period: how long stopped ranks' exits are waited for
DIVERGENCE_EXIT_CODE = 3  # the job stopped on a detected divergence (--on_divergence fail)


@dataclass
class Rank:
    """One rank of the job, and the process serving it now (cf. torchelastic's Worker).

    The process runs on node ``node`` and is owned by that node's agent; the coordinator knows it
    through the agent's reports: ``running`` from the spawn until its exit is reported, ``pid``
    once the agent (or the rank's hello) has told it.
    """

    rank: int
    local_rank: int
    node: int = 0
    incarnation: int = -1
    pid: int | None = None
    running: bool = False
    state: RankState = RankState.STARTING
    started_at: float = 0.0
    identity: bytes | None = None
    library: bool = False
    replica_group: tuple[int, ...] = ()
    last_heartbeat: float = 0.0
    step: int | None = None
    committed: int = NO_STATE
    metrics: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    exit_code: int | None = None
    exit_desc: str = ""
    # watchdog
    phase: str = "setup"  # setup, compute, collective, update, recovering, done
    last_progress: float = 0.0  # last step/collective/update/progress message
    last_begin: tuple[int, float] | None = None  # (step, time) of the last step begin
    samples: int = 0  # step times observed from this process
    steps_ended: bool = False
    kill_reason: str | None = None  # set when ftrun kills it (a hang)
    hung_since: float = 0.0  # the evidence's start (last heartbeat or progress)
    final_step: int | None = None  # the committed step it claimed when it called ft.finish()
    finished: bool = False  # it called ft.finish(): it waits in the finish barrier, then its code after that runs unwatched
    released: bool = False  # told that every rank finished (it leaves the finish barrier)
    in_dist: bool | None = None  # its last heartbeat: training thread inside torch.distributed (None: unknown)
    stage: str = "setup"  # its last heartbeat: where in ftrun's flow (ftrun.recovery.RankProgress.stage)
    stage_bytes: int = 0  # the bytes that stage moves (a transfer's state)
    outside_since: float | None = None  # first heartbeat of this stage seeing it outside torch.distributed
    total_steps: int | None = None  # the number of steps its loop runs (ft.steps(n)), when known
    last_step_seconds: float | None = None  # its latest step time (for stragglers)
    compute_seconds: float | None = None  # its latest step's start to its collective (its own work)
    section: str | None = None  # a named section it is in (evaluation, checkpoint writing): ft.section()
    section_timeout: float | None = None  # that section's own bound, seconds (None: unbounded)
    section_started: float = 0.0
    section_closed_at: float = 0.0  # when its last section closed (step times across it are not samples)

    def alive(self) -> bool:
        return self.running

    def status(self, now: float) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": self.pid,
            "state": self.state.value,
            "step": self.step,
            "metrics": self.metrics,
            "restarts": self.restarts,
            "incarnation": self.incarnation,
            "node": self.node,
            "total_steps": self.total_steps,
            "last_step_seconds": self.last_step_seconds,
            "compute_seconds": self.compute_seconds,
            "uptime": (now - self.started_at) if self.running else None,
            "exit": self.exit_desc or None,
        }


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


@dataclass
class Recovery:
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


class Coordinator:
    """The job coordinator: every job-wide decision, for the ranks of every node.

    Args:
        spec: the job.
        token: the job secret (handed to the ranks in their environment, never sent).
        events_addr: the node-0 launcher's PULL endpoint for events and status, or None.
        store_port: the port of the launcher's store (attempt 0's ``MASTER_PORT``).
        local_agent: node 0's agent (in this process); other nodes' agents connect over the
            control plane and are added as :class:`~ftrun.agent.RemoteAgent` when they say hello.
        clock: Unix time in seconds (injected by process-free tests).

    ``run()`` returns the job's exit code.
    """

    def __init__(self, spec: JobSpec, token: str, events_addr: str | None, store_port: int,
                 local_agent: AgentHandle | None = None, clock: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.token = token  # each node's agent gives it to its ranks; never sent on a socket
        self.sender = Sender(token)  # frames to ranks and agents
        self.receiver = Receiver(self.sender.auth, CONTROL)  # their frames: authentic and fresh
        self._event_sender = Sender(self.sender.auth)  # frames to node 0's launcher
        self.store_port = store_port
        self.log_dir = Path(spec.log_dir)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a second connection presenting a connected rank's identity is
        # refused, never given that rank's traffic. Oversized frames are dropped by ZeroMQ before
        # they are buffered (the connection that sent one is closed).
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # A connection that closes is seen at once (a killed host's kernel resets its connections):
        # an agent's connection closing is its node's loss, with no heartbeat timeout to wait for.
        self.disconnects = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._agent_fds: dict[int, bytes] = {}  # descriptor of an agent's connection -> its routing identity
        from .stores import bind_host

        bind = bind_host(spec.master_addr, spec.nnodes)
        port = self.router.bind_to_random_port(f"tcp://{bind}")
        self.control_addr = f"tcp://{'127.0.0.1' if bind == '127.0.0.1' else spec.master_addr}:{port}"
        self.clock = clock
        self.agents: dict[int, AgentHandle] = {}
        if local_agent is not None:
            self.agents[local_agent.node] = local_agent
        # node -> when its agent must have joined by: the job's start + --cluster_time_out, or a lost
        # node's loss + --node_wait_timeout (a replacement launcher with its index).
        self.node_deadline = {node: clock() + spec.cluster_time_out for node in range(1, spec.nnodes)}
        self._waiting_for: dict[int, str] = {}  # lost node -> why, while a replacement is awaited
        self._fenced: dict[bytes, int] = {}  # connection of a lost node's agent -> that node
        self._pending_spawns: dict[int, list[tuple[int, int, dict[str, str], str, bool]]] = {}
        self._next_agent_beat = 0.0
        self._spares_sent = 0.0
        self.lost_nodes: dict[int, str] = {}
        self._final_message: str | None = None
        self._unshared_warned = False
        self.observers: list[Callable[[Event], None]] = []  # called with every event (e.g. metrics)
        self.ttp_report_wait = TTP_REPORT_WAIT_S  # seconds (real time) live ranks get to report for a dying gasp
        self._hung: dict[tuple[int, int], tuple[Any, ...]] = {}  # (rank, incarnation) -> what the watchdog saw
        self.push: zmq.Socket | None = None
        if events_addr:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 2000)
            self.push.setsockopt(zmq.SNDHWM, 100_000)
            self.push.connect(events_addr)
        self.event_log = EventLog(open(self.log_dir / "events.jsonl", "a", encoding="utf-8"))
        local = spec.local_worker_num
        self.ranks = {rank: Rank(rank=rank, local_rank=rank % local, node=rank // local) for rank in range(spec.worker_num)}
        self.attempt = 0
        self.generation = 0
        self.restarts_used = 0
        self.failures: list[Failure] = []
        self.round_failures: list[Failure] = []
        self.recovery: Recovery | None = None
        self.stop_signal: int | None = None
        self.rejected = 0
        self._reject_counts: dict[bytes, int] = {}
        self._offenders: set[bytes] = set()
        self.attempt_store: Any = None
        self.main_store: Any = None
        self._status_dirty = True
        self._last_status = 0.0
        self._pending_exit: int | None = None
        self.max_step_time: float | None = None  # largest step time seen after warm-up (seconds)
        self.checkpoint_root = Path(spec.checkpoint_dir).resolve()
        self.resume_from: ckpt.Manifest | None = None  # the checkpoint this attempt starts from
        self.pending_saves: dict[int, dict[int, Message]] = {}  # step -> shard -> its SAVED report
        self._gasp: dict[str, Any] | None = None  # the dying gasp in progress
        self._unrepaired: tuple[float, str] | None = None  # a fault reported that no switch repairs
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_w, False)
        os.set_blocking(self._wakeup_r, False)

    # ----------------------------------------------------------------- events and status
    def emit(self, kind: EventKind, message: str, rank: int | None = None, **detail: Any) -> Event:
        """Record an event in events.jsonl and push it to the launcher."""
        r = self.ranks.get(rank) if rank is not None else None
        event = Event(
            kind=kind,
            message=message,
            rank=rank,
            pid=detail.pop("pid", None) or (r.pid if r else None),
            incarnation=r.incarnation if r else None,
            generation=self.generation,
            attempt=self.attempt,
            node=r.node if r is not None else self.spec.node_rank,
            detail=detail,
        )
        self.event_log.write(event)
        log.info("%s %s", kind.value, message)
        if self.push is not None:
            self.push.send(encode(MsgType.EVENT, self._event_sender, events_for(0), event=event.to_json()))
        for observer in self.observers:
            try:
                observer(event)
            except Exception:  # an observer (metrics) must never break the job
                log.exception("event observer failed")
        self._status_dirty = True
        return event

    def status_snapshot(self, now: float) -> dict[str, Any]:
        """The job as ``ftrun status`` shows it: its phase, counters and every rank's row."""
        return {
            "ranks": [r.status(now) for r in self.ranks.values()],
            "attempt": self.attempt,
            "generation": self.generation,
            "restarts_used": self.restarts_used,
            "max_restarts": self.spec.max_restarts,
            "recovering": self.recovery is not None,
            "world_size": self.spec.worker_num,
            "nnodes": self.spec.nnodes,
            "lost_nodes": {str(k): v for k, v in self.lost_nodes.items()},
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "updated": time.time(),
        }

    def publish_status(self, force: bool = False, final: dict[str, Any] | None = None) -> None:
        """Push a status snapshot to the launcher (the console) and keep ``LOG_DIR/status.json``
        current for ``ftrun status`` (at most every :data:`STATUS_PERIOD_S` seconds; ``final``: the
        job's end, written once)."""
        now = self.clock()
        if not (force or final or (self._status_dirty and now - self._last_status >= STATUS_PERIOD_S)):
            return
        snapshot = self.status_snapshot(now)
        snapshot["state"] = "running" if final is None else ("succeeded" if final["exit_code"] == 0 else "failed")
        if final is not None:
            snapshot.update(final)
        if self.push is not None:
            self.push.send(encode(MsgType.STATUS, self._event_sender, events_for(0), ranks=snapshot["ranks"], attempt=self.attempt,
                                  generation=self.generation))
        write_status_file(self.log_dir / "status.json", snapshot)
        self._status_dirty = False
        self._last_status = now

    # ----------------------------------------------------------------- stores
    def _attempt_store_port(self) -> int:
        """The port of the store this attempt's ranks rendezvous on (their MASTER_PORT).

        Attempt 0 uses the launcher's store on ``--master_port``, as a torchrun user expects. Every
        later attempt gets a fresh store, hosted here on node 0 (the ranks of every node get its
        port in their variables), because an unmodified ``env://`` script would otherwise meet the
        keys of the attempt before it (the stale-address failure of torchrun's shared store).
        """
        if self.attempt == 0:
            return self.store_port
        from .stores import bind_host, serve_store  # imports torch: only a whole-job restart needs it

        self.attempt_store = None  # release the previous attempt's store first
        self.attempt_store, port = serve_store(bind_host(self.spec.master_addr, self.spec.nnodes), 0, self.spec.cluster_time_out)
        return port

    def publish_control_addr(self) -> None:
        """Tell the other nodes' launchers where the control plane is, through the launcher's store
        (the address is no secret: every frame on it is authenticated). First, leave a marker in
        the checkpoint directory that each agent looks for (multi-node TTP needs one directory that
        every node sees)."""
        if self.spec.nnodes == 1:
            return
        if self.spec.tft.ttp:
            try:
                self.checkpoint_root.mkdir(parents=True, exist_ok=True)
                (self.checkpoint_root / shared_dir_marker(self.control_addr, self.token)).write_text("ftrun\n")
            except OSError as err:
                self.emit(EventKind.WARNING, f"cannot write to --checkpoint_dir {self.checkpoint_root}: {err}")
        from torch.distributed import TCPStore

        self.main_store = TCPStore(self.spec.master_addr, self.store_port, is_master=False,
                                   timeout=_timedelta(self.spec.cluster_time_out))
        self.main_store.set("ftrun/control_addr", self.control_addr)

    # ----------------------------------------------------------------- spawning
    def rank_vars(self, r: Rank, attempt_port: int) -> dict[str, str]:
        """The variables of one rank's environment: torchrun's and msrun's contract plus ftrun's
        own. The agent of the rank's node adds them to that node's environment."""
        spec = self.spec
        out = {
            # torchrun
            "RANK": str(r.rank),
            "LOCAL_RANK": str(r.local_rank),
            "WORLD_SIZE": str(spec.worker_num),
            "LOCAL_WORLD_SIZE": str(spec.local_worker_num),
            "GROUP_RANK": str(r.node),
            "GROUP_WORLD_SIZE": str(spec.nnodes),
            "ROLE_RANK": str(r.rank),
            "ROLE_WORLD_SIZE": str(spec.worker_num),
            "ROLE_NAME": "default",
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(attempt_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            # msrun
            "RANK_ID": str(r.rank),
            "RANK_SIZE": str(spec.worker_num),
            "MS_WORKER_NUM": str(spec.worker_num),
            "MS_LOCAL_WORKER": str(spec.local_worker_num),
            "MS_NODE_RANK": str(r.node),
            "MS_ROLE": "MS_WORKER",
            "MS_SCHED_HOST": spec.master_addr,
            "MS_SCHED_PORT": str(self.store_port),
            "DEVICE_ID": str(r.local_rank),
            # ftrun worker library
            "FTRUN_CONTROL_ADDR": self.control_addr,
            "FTRUN_INCARNATION": str(r.incarnation),
            "FTRUN_GENERATION": str(self.generation),
            "FTRUN_ATTEMPT": str(self.attempt),
            "FTRUN_HEARTBEAT_INTERVAL": str(spec.heartbeat_interval),
            "FTRUN_PG_TIMEOUT": str(spec.pg_timeout),
            "FTRUN_CLUSTER_TIME_OUT": str(spec.cluster_time_out),
            "FTRUN_ARF": "1" if spec.tft.arf else "0",
            "FTRUN_UCE": "1" if spec.tft.uce else "0",
            "FTRUN_TTP": "1" if spec.tft.ttp else "0",
            "FTRUN_RECOVERABLE_ERRORS": ",".join(spec.recoverable_errors),
            "FTRUN_ON_DIVERGENCE": spec.on_divergence,
            "FTRUN_CHECKPOINT_DIR": str(self.checkpoint_root),
            "FTRUN_SAVE_STEPS": str(spec.save_steps),
            "PYTHONUNBUFFERED": "1",
        }
        if self.resume_from is not None:
            out["FTRUN_RESUME_DIR"] = str(self.resume_from.directory)
            out["FTRUN_RESUME_STEP"] = str(self.resume_from.step)
        return out

    def spawn(self, r: Rank, attempt_port: int, use_spare: bool = False) -> None:
        """Have the agent of ``r``'s node start its next incarnation (in a warm spare if
        ``use_spare`` and one is idle there). The ``rank_started`` event follows the agent's report."""
        r.incarnation += 1
        r.identity = None  # r.library stays: a respawned rank runs the same script as before
        r.pid = None
        r.running = True
        r.step = None
        r.committed = NO_STATE
        r.metrics = {}
        r.exit_code = None
        r.exit_desc = ""
        r.state = RankState.STARTING
        r.last_heartbeat = 0.0
        r.phase, r.last_progress, r.last_begin, r.samples = "setup", 0.0, None, 0
        r.steps_ended, r.kill_reason, r.hung_since, r.final_step, r.finished = False, None, 0.0, None, False
        r.released = False
        r.in_dist, r.stage, r.stage_bytes, r.outside_since = None, "setup", 0, None
        r.section, r.section_timeout, r.section_started, r.section_closed_at = None, None, 0.0, 0.0
        r.started_at = self.clock()
        header = (
            f"===== ftrun: rank {r.rank} incarnation {r.incarnation} attempt {self.attempt} "
            f"generation {self.generation} started {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        )
        order = (r.rank, r.incarnation, self.rank_vars(r, attempt_port), header, use_spare)
        agent = self.agents.get(r.node)
        if agent is None:
            self._pending_spawns.setdefault(r.node, []).append(order)  # sent when its agent joins
        else:
            agent.spawn(*order)

    def on_spawned(self, r: Rank, pid: int, spare: str) -> None:
        if r.pid is None:
            r.pid = pid
        self.emit(
            EventKind.RANK_STARTED,
            f"rank {r.rank} started (pid {pid}, incarnation {r.incarnation}{f', in a {spare} spare' if spare else ''}"
            f"{f', node {r.node}' if self.spec.nnodes > 1 else ''})",
            rank=r.rank,
            pid=pid,
            log=str(self.log_dir / f"worker_{r.rank}.log"),
            warm_spare=spare == "warm",
            hot_spare=spare == "hot",
            node=r.node,
        )

    # ----------------------------------------------------------------- warm spares
    def keep_spares(self) -> None:
        """Keep warm spares on every node once a rank has said hello through the worker library
        (only such jobs use ARF; the spare imports while the ranks set up), never while a recovery
        runs (it would compete with the recovery for the CPU)."""
        spec = self.spec
        if (
            not spec.tft.arf
            or spec.no_python
            or self.recovery is not None
            or not any(r.library for r in self.ranks.values())
        ):
            return
        hot = spec.hot_spares > 0
        if hot and not all(r.step is not None or r.state == RankState.SUCCEEDED for r in self.ranks.values()):
            return  # hot spares run the script's set-up: only once the ranks are past theirs
        now = self.clock()
        if now - self._spares_sent < 1.0:
            return  # at most once a second: an agent refills what a promotion used
        self._spares_sent = now
        for node, agent in self.agents.items():
            model = next((r for r in self.ranks.values() if r.node == node), None)
            if model is not None and agent.connected():
                model_vars = self.rank_vars(model, self.attempt_port)
                model_vars[SPARE_MODE_VAR] = "hot" if hot else "warm"
                agent.keep_spares(spec.hot_spares if hot else spec.warm_spares, model_vars)

    def start_attempt(self) -> None:
        self.attempt_port = self._attempt_store_port()
        self.resume_from = self.choose_checkpoint()
        self.pending_saves.clear()
        for r in self.ranks.values():
            self.spawn(r, self.attempt_port)

    def choose_checkpoint(self) -> ckpt.Manifest | None:
        """The checkpoint this attempt starts from: ``--resume`` for the first attempt (``auto``:
        the newest complete one, when TTP is on), the newest complete one for a whole-job restart.
        Each checkpoint skipped (no manifest, a size or checksum mismatch) is a warning event."""
        spec = self.spec

        def skipped(path: Path, reason: str) -> None:
            self.emit(EventKind.WARNING, f"skipping checkpoint {path}: {reason}", path=str(path), reason=reason)

        choice = spec.resume
        if choice == "auto" and not spec.tft.ttp:
            choice = "none"
        manifest = None
        try:
            if self.attempt > 0 and choice != "none":
                manifest = ckpt.find_latest(self.checkpoint_root, skipped) or self.resume_from
            else:
                manifest = ckpt.resolve_resume(self.checkpoint_root, choice, skipped)
        except ckpt.CheckpointError as err:  # checked by the launcher; it may have changed since
            skipped(err.path, err.problem)
        if manifest is not None and manifest.world_size != spec.worker_num:
            skipped(manifest.directory, f"written by {manifest.world_size} ranks, this job has {spec.worker_num}")
            manifest = None
        if manifest is not None:
            self.emit(
                EventKind.RESUMED,
                f"starting from checkpoint {manifest.directory} (step {manifest.step}; training resumes at step {manifest.step + 1})",
                path=str(manifest.directory),
                step=manifest.step,
            )
        return manifest

    # ----------------------------------------------------------------- main loop
    def run(self) -> int:
        """Run the job to its end and return the exit code."""
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"ftrun-{os.getppid()}-{int(self.clock())}"
        self._install_signals()
        spec = self.spec
        self.emit(
            EventKind.JOB_STARTED,
            f"job started: {spec.worker_num} rank(s), {spec.local_worker_num} on node {spec.node_rank}, "
            f"max_restarts={spec.max_restarts}, TFT={spec.tft}",
            script=spec.script,
            args=list(spec.script_args),
            control=self.control_addr,
        )
        for warning in getattr(spec, "warnings", ()):
            self.emit(EventKind.WARNING, warning)
        for name in spec.tft.not_implemented() if spec.tft_explicit else ():
            self.emit(EventKind.WARNING, f"TFT switch {name} is on but not implemented in this version of ftrun; it has no effect")
        interface_note = getattr(getattr(self.agents.get(0), "processes", None), "interface_note", None)
        if interface_note:
            self.emit(EventKind.WARNING, interface_note)
        self.publish_control_addr()
        self.start_attempt()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.disconnects, zmq.POLLIN)
        poller.register(self._wakeup_r, zmq.POLLIN)
        exit_code: int | None = None
        while exit_code is None:
            poller.poll(timeout=int(spec.monitor_interval * 1000))
            self._drain_wakeup()
            if self.stop_signal is not None:
                exit_code = self.stop(128 + self.stop_signal, f"stopped by {signal.Signals(self.stop_signal).name}")
                break
            exit_code = self.check_processes()
            if exit_code is not None:
                break
            self.read_messages()
            exit_code = self._pending_exit
            if exit_code is None:
                exit_code = self.check_agents()
            if exit_code is None:
                self.check_hangs()
                exit_code = self._pending_exit
            if exit_code is None and (self.spec.warm_spares or self.spec.hot_spares):
                self.keep_spares()
            self.publish_status()
        self.publish_status(final={"exit_code": exit_code, "message": self._final_message or ""})
        self.shutdown_agents(exit_code)
        self.close()
        return exit_code

    # ----------------------------------------------------------------- node agents
    def shutdown_agents(self, code: int) -> None:
        """Tell every agent the job is over (each exits with ``code``); stop the local spares."""
        message = self._final_message or f"job finished with exit code {code}"
        for agent in self.agents.values():
            agent.shutdown(code, message)

    def check_agents(self) -> int | None:
        """Beat to the other nodes' agents; declare a node lost when its agent is silent for
        ``--heartbeat_timeout`` seconds, or when an agent never joined within ``--cluster_time_out``.

        Until node replacement exists, a lost node ends the job: the survivors write a dying-gasp
        checkpoint and the failure names the node.
        """
        now = self.clock()
        timeout = max(self.spec.heartbeat_timeout, 3 * self.spec.heartbeat_interval)
        if now >= self._next_agent_beat:
            self._next_agent_beat = now + self.spec.heartbeat_interval
            for agent in self.agents.values():
                if isinstance(agent, RemoteAgent):
                    agent.beat()
        closed = self.closed_agent_connections()
        for node in range(self.spec.nnodes):
            agent = self.agents.get(node)
            if isinstance(agent, RemoteAgent) and not agent.lost and not agent.leaving and agent.identity in closed:
                return self.node_lost(node, f"node {node} lost: its agent's connection closed (host {agent.host or '?'}; "
                                            "its processes were killed or its host reset the connection)")
            if agent is None and node in self._waiting_for and now > self.node_deadline[node]:
                reason = (f"{self._waiting_for.pop(node)}; no replacement joined within --node_wait_timeout "
                          f"{self.spec.node_wait_timeout:g} s")
                return self.finish_failed(reason)
            if agent is None and node not in self.lost_nodes and now > self.node_deadline.get(node, float("inf")):
                return self.node_lost(node, f"node {node} did not join within --cluster_time_out {self.spec.cluster_time_out:g} s",
                                      replaceable=False)
            if isinstance(agent, RemoteAgent) and not agent.lost and agent.leaving:
                return self.node_lost(node, f"node {node} left the job: {agent.leaving} (host {agent.host or '?'})")
            if isinstance(agent, RemoteAgent) and not agent.lost and now - agent.last_seen > timeout:
                return self.node_lost(node, f"node {node} lost: nothing heard from its agent for {now - agent.last_seen:.1f} s "
                                            f"(host {agent.host or '?'})")
        return None

    def closed_agent_connections(self) -> set[bytes]:
        """The agent connections (routing identities) that have closed since the last call (the
        ROUTER's monitor: each connection's descriptor was recorded from its agent's hello,
        ``SRCFD``). A lost node's old agent, fenced, or a replaced one is not its node's agent any
        more: the caller checks the identity against the node's current agent."""
        from zmq.utils.monitor import recv_monitor_message

        identities: set[bytes] = set()
        while True:
            try:
                event = recv_monitor_message(self.disconnects, zmq.NOBLOCK)
            except zmq.Again:
                return identities
            identity = self._agent_fds.pop(event["value"], None)
            if identity is not None:
                identities.add(identity)

    def node_lost(self, node: int, reason: str, replaceable: bool = True) -> int | None:
        """A node is gone with its ranks (pod-level rescheduling, MindCluster's term).

        Its agent's connection is fenced (any later message from it is answered with ``shutdown``),
        its ranks are recorded as failed, and the failure goes through the same policy as a rank's
        death. With ARF on, the survivors are aborted to a safe point and the node's ranks are
        respawned as soon as a replacement launcher with that node's index joins (from any host,
        within ``--node_wait_timeout``), then recover from replicas on the surviving nodes; a
        whole-job restart likewise waits for the node. Without ARF, or past the budget, the job
        fails after a dying-gasp checkpoint. Returns the exit code once the job ends.
        """
        agent = self.agents.pop(node, None)
        if isinstance(agent, RemoteAgent):
            agent.lost = True
            self._fenced[agent.identity] = node
        self._pending_spawns.pop(node, None)
        self.lost_nodes[node] = reason
        now = self.clock()
        lost = [r for r in self.ranks.values() if r.node == node and r.state != RankState.SUCCEEDED]
        for r in lost:
            r.running = False
            r.exit_code, r.exit_desc, r.state = 1, reason, RankState.FAILED
            failure = Failure(r.rank, r.pid, 1, reason, now)
            self.failures.append(failure)
            self.round_failures.append(failure)
        waits = replaceable and self.spec.tft.arf and bool(lost) and not self.spec.join
        self.emit(EventKind.NODE_LOST, reason + (f"; waiting up to {self.spec.node_wait_timeout:g} s for a replacement "
                                                 f"launcher with --node_rank {node}" if waits else ""),
                  node_lost=node, ranks=[r.rank for r in lost], waiting=waits)
        if not waits:
            return self.finish_failed(reason)
        self._waiting_for[node] = reason
        self.node_deadline[node] = now + self.spec.node_wait_timeout
        self.publish_vacancies()
        return self.on_failure([r.rank for r in lost])

    def publish_vacancies(self) -> None:
        """Keep ``ftrun/vacant`` in the job's store: the node indices awaiting a replacement,
        comma-separated (a launcher started without ``--node_rank`` takes one; see
        :func:`ftrun.launcher.claim_node_rank`)."""
        if self.main_store is None:
            return
        try:
            self.main_store.set("ftrun/vacant", ",".join(str(n) for n in sorted(self._waiting_for)))
        except Exception as err:  # the store is node 0's launcher's: gone only if the job is ending
            log.warning("cannot publish vacant node indices: %s", err)

    def on_agent_message(self, identity: bytes, msg: Message, fd: int | None = None) -> None:
        """An agent's hello, beat or report. A hello binds the node to the connection that sent
        it (a replacement for a lost node is accepted while it is awaited); any other agent message
        must come from that connection; a fenced connection (a lost node's old agent, back after a
        partition) is told to shut down."""
        now = self.clock()
        node = msg.get("node")
        if identity in self._fenced:
            self.reject(identity, f"{msg.type.value} from node {self._fenced[identity]}'s old agent, which was "
                                  "declared lost: fenced (told to stop its ranks)")
            self._send_to(identity, MsgType.SHUTDOWN, {"code": 1, "message": (
                f"node {self._fenced[identity]} was declared lost and is fenced off; its ranks belong to an old "
                "generation and are stopped")})
            return
        if msg.type == MsgType.AGENT_HELLO:
            if not isinstance(node, int) or not 0 < node < self.spec.nnodes:
                self.reject(identity, f"agent hello for node {node!r}: not a node of this job")
                return
            current = self.agents.get(node)
            if (isinstance(current, RemoteAgent) and self.spec.tft.arf
                    and now - current.last_seen > 2 * self.spec.heartbeat_interval):
                # A replacement launcher (a restarted pod) can say hello before the old agent's
                # silence reaches --heartbeat_timeout: the old one is already quiet, so it is lost.
                result = self.node_lost(node, f"node {node} replaced: a new launcher joined while its agent had "
                                              f"been silent for {now - current.last_seen:.1f} s")
                if result is not None:
                    self._pending_exit = result
                    return
            if node in self.agents or (node in self.lost_nodes and node not in self._waiting_for):
                why = ("was declared lost and is not awaited any more" if node in self.lost_nodes
                       else "is already connected")
                self.reject(identity, f"agent hello for node {node}, which {why}")
                self._send_to(identity, MsgType.SHUTDOWN, {"code": 1, "message": f"node {node} {why}"})
                return
            replacing = self._waiting_for.pop(node, None)
            if replacing is not None:
                self.publish_vacancies()
            agent = RemoteAgent(node=node, identity=identity, send_frame=self._send_to, last_seen=now,
                                host=msg["host"], pid=msg["pid"])
            self.agents[node] = agent
            if fd is not None:
                self._agent_fds[fd] = identity
            self.emit(EventKind.NODE_JOINED,
                      f"{'a replacement for ' if replacing else ''}node {node} joined (host {msg['host']}, agent pid {msg['pid']})",
                      node_joined=node, replacement=replacing is not None)
            if self.spec.tft.ttp and msg.get("sees_checkpoint_dir") is False and not self._unshared_warned:
                self._unshared_warned = True
                self.emit(EventKind.WARNING,
                          f"--checkpoint_dir {self.checkpoint_root} is not shared with node {node} (host {msg['host']}): "
                          "checkpoints need one directory every node sees (a shared file system); shards written "
                          "there would be missing here")
            for order in self._pending_spawns.pop(node, []):
                self.ranks[order[0]].started_at = self.clock()  # its set-up time counts from now
                agent.spawn(*order)
            return
        agent = self.agents.get(node) if isinstance(node, int) else None
        if not isinstance(agent, RemoteAgent) or agent.identity != identity or agent.lost:
            self.reject(identity, f"{msg.type.value} from a connection that is not node {node!r}'s agent")
            return
        agent.on_message(msg, now)

    def _send_to(self, identity: bytes, msg_type: MsgType, fields: dict[str, Any]) -> None:
        self.router.send_multipart([identity, encode(msg_type, self.sender, to_peer(identity), **fields)])

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wakeup_w)
        processes = getattr(self.agents.get(0), "processes", None)

        def on_stop(signum: int, _frame: Any) -> None:
            self.stop_signal = signum

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        def on_child(_signum: int, _frame: Any) -> None:
            # The kernel sends SIGCHLD as a child dies: its arrival time dates the death, which is
            # what detection latency is measured from. The wakeup fd wakes the poll.
            if processes is not None and processes.sigchld_at is None:
                processes.sigchld_at = self.clock()

        signal.signal(signal.SIGCHLD, on_child)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wakeup_r, 4096):
                pass
        except BlockingIOError:
            pass

    # ----------------------------------------------------------------- process health
    def collect_reports(self) -> list[Rank]:
        """Take every agent's reports (spawned, exited, stacks) and apply them; return the ranks
        that failed (exited non-zero) in them."""
        now = self.clock()
        newly_failed: list[Rank] = []
        for agent in list(self.agents.values()):
            for report in agent.take_reports():
                if isinstance(report, SpareNote):
                    self.emit(EventKind.WARNING, f"node {agent.node}: {report.message}", fault="hot_spare_contract")
                    continue
                r = self.ranks.get(report.rank)
                if r is None or report.incarnation != r.incarnation:
                    continue  # an older process of the rank: nothing to act on
                if isinstance(report, Spawned):
                    self.on_spawned(r, report.pid, report.spare)
                elif isinstance(report, Stacks):
                    self.on_stacks(r, report)
                elif isinstance(report, StopReport) and r.running and r.kill_reason is None:
                    # Frozen by a signal: its parent saw it at once; no need to wait for the heartbeats.
                    r.hung_since = report.at
                    try:
                        name = signal.Signals(report.signal).name
                    except ValueError:
                        name = f"signal {report.signal}"
                    self.declare_hung(r, "stopped", f"stopped by {name} (seen by its parent at once)")
                elif isinstance(report, ExitReport) and r.running and getattr(agent, "leaving", None):
                    r.running = False  # its node is leaving the job: a node loss, handled as one
                    r.exit_code, r.exit_desc = procs.describe_exit(report.returncode)
                elif isinstance(report, ExitReport) and r.running:
                    if self.on_exit(r, report, now):
                        newly_failed.append(r)
        return newly_failed

    def on_exit(self, r: Rank, report: ExitReport, now: float) -> bool:
        """Record a rank's exit; True when it failed."""
        r.running = False
        if r.pid is None:
            r.pid = report.pid
        code, desc = procs.describe_exit(report.returncode)
        if r.kill_reason is not None:
            desc = f"{r.kill_reason}; killed by ftrun"
        elif report.error:
            desc = f"{desc}: {report.error}"  # the exception torchrun's @record wrote
        r.exit_code, r.exit_desc = code, desc
        if code == 0:
            r.state = RankState.SUCCEEDED
            self.emit(EventKind.RANK_EXITED, f"rank {r.rank} finished ({desc})", rank=r.rank, exit_code=0)
            return False
        r.state = RankState.FAILED
        evidence_at = r.hung_since if r.kill_reason is not None else report.at
        failure = Failure(r.rank, r.pid, code, desc, now, detection_seconds=max(0.0, now - evidence_at),
                          log_tail=tuple(report.log_tail))
        self.failures.append(failure)
        self.round_failures.append(failure)
        self.emit(
            EventKind.RANK_FAILED,
            f"rank {r.rank} failed: {desc} (pid {r.pid}, step {r.step}{f', node {r.node}' if self.spec.nnodes > 1 else ''})",
            rank=r.rank,
            exit_code=code,
            cause=desc,
            step=r.step,
            committed=r.committed,
            node=r.node,
            detected_at=now,
            detection_seconds=round(failure.detection_seconds, 4),
            **({"log_tail": list(report.log_tail)} if report.log_tail else {}),
        )
        return True

    def check_processes(self) -> int | None:
        """Apply the agents' reports and act on failures. Returns the job's exit code once it ends."""
        newly_failed = self.collect_reports()
        if newly_failed:
            result = self.on_failure([r.rank for r in newly_failed])
            if result is not None:
                return result
        self.release_finish_barrier()  # a rank may have exited 0 without ft.finish(), or a recovery ended
        if all(r.state == RankState.SUCCEEDED for r in self.ranks.values()):
            self._final_message = "job succeeded"
            self.emit(EventKind.JOB_FINISHED, "job succeeded", exit_code=0, restarts=self.restarts_used)
            return 0
        if self.spec.join and any(r.state == RankState.FAILED for r in self.ranks.values()):
            if all(not r.alive() for r in self.ranks.values()):
                return self.finish_failed("a rank failed and --join let the others finish")
        return None

    def on_failure(self, failed: list[int]) -> int | None:
        spec = self.spec
        if spec.join:
            return None
        if self.unusable_checkpoint() is not None:
            return self.restart_job(f"rank(s) {sorted(failed)} failed")
        others = [r for r in self.ranks.values() if r.rank not in failed]
        if (others and all(r.state == RankState.SUCCEEDED for r in others)
                and all(not self.ranks[f].library and self.ranks[f].exit_code in TEARDOWN_CRASH_CODES for f in failed)):
            # A plain script whose rank crashes in its teardown after every other rank finished (seen
            # with Hugging Face Trainer: "terminate called without an active exception", SIGABRT, at
            # exit). The job's work is done on the others; a whole-job restart would train again from
            # the start. Any other failure (an error code, SIGKILL: an OOM kill mid-work) restarts.
            return self.finish_failed(
                f"rank(s) {sorted(failed)} crashed ({self.ranks[failed[0]].exit_desc}) after every other rank had "
                "finished successfully (exit code 0): not restarted (a restart would run the whole script again); "
                "the training likely completed: check the rank's log for what failed at its end")
        decision = decide_on_failure(
            failed,
            world_size=spec.worker_num,
            arf=spec.tft.arf,
            library_ranks=[r.rank for r in self.ranks.values() if r.library],
            restarts_used=self.restarts_used,
            max_restarts=spec.max_restarts,
        )
        if decision.action == Action.FAIL_JOB:
            return self.finish_failed(decision.reason)
        if decision.action == Action.RESPAWN_RANKS:
            self.start_recovery(set(decision.ranks), decision.reason)
            return None
        return self.restart_job(decision.reason)

    def unusable_checkpoint(self) -> tuple[Path, str] | None:
        """(file, problem) when a rank found that the checkpoint this attempt started from does not
        load (:func:`ftrun.checkpoint.mark_unusable`): the attempt's failure is the checkpoint's."""
        return ckpt.read_unusable_note(self.resume_from.directory) if self.resume_from is not None else None

    def restart_job(self, reason: str) -> int | None:
        """Stop every rank and start them all again (torchrun semantics), from the newest checkpoint
        (a dying-gasp one if the live ranks could write it)."""
        unusable = self.unusable_checkpoint()
        if unusable is not None:
            # The attempt's checkpoint does not load (its ranks marked it): not the job's fault, so
            # no restart is counted; the next attempt skips it for the next older one.
            reason = f"{reason}; checkpoint {self.resume_from.directory} is unusable: {unusable[0]} {unusable[1]}"
        elif self.restarts_used + 1 > self.spec.max_restarts:
            return self.finish_failed(f"{reason}; restart budget exhausted (max_restarts={self.spec.max_restarts})")
        else:
            self.dying_gasp(reason)
            self.restarts_used += 1
        self.emit(
            EventKind.JOB_RESTARTING,
            f"restarting all ranks: {reason} (restart {self.restarts_used}/{self.spec.max_restarts})",
            reason=reason,
            restarts_used=self.restarts_used,
        )
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.exit_code is None:
                r.state = RankState.STOPPED
            r.restarts += 1
            r.library = False
        self.recovery = None
        self.round_failures = []
        self.attempt += 1
        self.generation = 0
        self.start_attempt()
        return None

    def stop_all_ranks(self) -> None:
        """Stop every rank on every node (SIGTERM, SIGKILL after ``--grace_period``) and wait until
        each exit is reported, at most :data:`STOP_REPORT_WAIT_S` seconds past the grace period
        (a rank whose node is lost is taken as stopped). Exits seen here are stops, not failures."""
        self._pending_spawns.clear()
        for agent in self.agents.values():
            agent.stop_ranks(self.spec.grace_period)
        deadline = time.monotonic() + self.spec.grace_period + STOP_REPORT_WAIT_S
        while True:
            for agent in self.agents.values():
                for report in agent.take_reports():
                    r = self.ranks.get(report.rank)
                    if r is None or report.incarnation != r.incarnation:
                        continue
                    if isinstance(report, Spawned):
                        self.on_spawned(r, report.pid, report.spare)
                    elif isinstance(report, Stacks):
                        self.on_stacks(r, report)
                    elif isinstance(report, ExitReport) and r.running:
                        r.running = False
                        r.exit_code, r.exit_desc = procs.describe_exit(report.returncode)
            for r in self.ranks.values():
                agent = self.agents.get(r.node)
                if r.running and (agent is None or not agent.connected()):
                    r.running = False  # nobody left to stop it or to tell
            if not any(r.running for r in self.ranks.values()) or time.monotonic() > deadline:
                return
            if self.router.poll(timeout=50):
                self.read_messages(agents_only=True)

    def finish_failed(self, reason: str) -> int:
        self.dying_gasp(reason)
        resume_hint = self.resume_hint()
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.state = RankState.STOPPED
        root = (self.round_failures or self.failures)[0]
        tail, same = self.first_failure_tail(root.rank)
        self._final_message = f"job failed: {reason}; root cause: rank {root.rank} ({root.description}){same}{resume_hint}"
        self.emit(
            EventKind.JOB_FINISHED,
            self._final_message,
            rank=root.rank,
            pid=root.pid,
            exit_code=root.exit_code,
            reason=reason,
            root_cause={"rank": root.rank, "pid": root.pid, "exit_code": root.exit_code, "cause": root.description},
            log_tail=tail,
            restarts=self.restarts_used,
        )
        return root.exit_code

    def first_failure_tail(self, rank: int) -> tuple[list[str], str]:
        """The end of the log of ``rank``'s first failed incarnation (its first traceback, not a
        later incarnation's warnings), and a note when every incarnation of it failed the same way
        (the same last line: a script error no respawn can repair)."""
        mine = [f for f in self.failures if f.rank == rank]
        tails = [f.log_tail for f in mine if f.log_tail]
        if not tails:
            return tail_lines(self.log_dir / f"worker_{rank}.log", 20), ""
        last_lines = {tail[-1].strip() for tail in tails}
        same = ""
        if len(mine) > 1 and len(tails) == len(mine) and len(last_lines) == 1:
            same = f"; each of its {len(mine)} incarnations failed the same way ({tails[0][-1].strip()[:200]})"
        return list(tails[0]), same

    def stop(self, code: int, reason: str) -> int:
        self.emit(EventKind.STOP_REQUESTED, f"{reason}: stopping all ranks (grace {self.spec.grace_period:g} s)")
        self.dying_gasp(reason)
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.state = RankState.STOPPED
        self._final_message = f"job {reason}{self.resume_hint()}"
        self.emit(EventKind.JOB_FINISHED, self._final_message, exit_code=code, reason=reason)
        return code

    # ----------------------------------------------------------------- ARF recovery
    def start_recovery(self, failed: set[int], reason: str, kind: str = "death") -> None:
        """Begin (or restart) a recovery round: respawn ``failed`` and ask survivors to report.

        ``kind`` names the fault for the events: death, hang, comm_error (HCCE) or
        recoverable_error (UCE); the last two respawn nothing.
        """
        now = self.clock()
        self.generation += 1
        for x in self.ranks.values():
            x.last_begin = None  # a step time measured across a recovery says nothing about steps
        if self.recovery is None:
            detection = max((f.detection_seconds for f in self.round_failures if f.rank in failed), default=0.0)
            self.recovery = Recovery(
                generation=self.generation, started_at=now - detection, failed=set(failed), detection_seconds=detection,
                round_started=now,
            )
            self.emit(
                EventKind.RECOVERY_STARTED,
                f"recovery of rank(s) {sorted(failed)} started: generation {self.generation}"
                if failed else f"{_KIND_LABEL.get(kind, kind)}: {reason}; rebuilding the group (generation {self.generation}), no respawn",
                failed=sorted(failed),
                reason=reason,
                fault=kind,
            )
        else:
            rec = self.recovery
            rec.generation = self.generation
            rec.failed |= failed
            rec.reports.clear()
            rec.plan = None
            rec.recovered.clear()
            rec.rounds += 1
            rec.round_started = now
            self.emit(
                EventKind.RECOVERY_STARTED,
                f"recovery restarted (round {rec.rounds}): rank(s) {sorted(failed)} failed during recovery; "
                f"generation {self.generation}",
                failed=sorted(failed),
                reason=reason,
                round=rec.rounds,
                fault=kind,
            )
        for rank in sorted(failed):
            r = self.ranks[rank]
            self.restarts_used += 1
            r.restarts += 1
            self.spawn(r, self.attempt_port, use_spare=True)
            self.recovery.respawned_at[rank] = self.clock()
            self.emit(
                EventKind.RANK_RESPAWNED,
                f"rank {rank} respawned as incarnation {r.incarnation} (restart {self.restarts_used}/{self.spec.max_restarts})",
                rank=rank,
                restarts_used=self.restarts_used,
            )
        for r in self.ranks.values():
            if r.alive() and r.rank not in failed:
                r.state = RankState.RECOVERING
                self.send(r, MsgType.ABORT, generation=self.generation, reason=reason)

    def on_report(self, r: Rank, generation: int, committed: int) -> None:
        rec = self.recovery
        if rec is None or generation != rec.generation:
            return
        rec.reports[r.rank] = committed
        r.state = RankState.RECOVERING
        live = [x.rank for x in self.ranks.values() if x.alive()]
        if rec.plan is None and set(live) <= set(rec.reports):
            self.make_plan(live)

    def make_plan(self, live: list[int]) -> None:
        rec = self.recovery
        assert rec is not None
        try:
            groups = self.replica_groups()
            plan = plan_recovery({rank: rec.reports[rank] for rank in live}, groups)
        except (NoLiveReplica, ValueError) as err:
            self.emit(EventKind.RECOVERY_FALLBACK, f"ARF cannot recover: {err}; falling back to a whole-job restart", reason=str(err))
            result = self.restart_job(f"no live replica ({err})")
            if result is not None:
                self._pending_exit = result
            return
        rec.plan = plan
        rec.planned_at = self.clock()
        transfers = [[t.donor, t.recipient] for t in plan.transfers]
        self.emit(
            EventKind.RECOVERY_PLANNED,
            f"generation {rec.generation}: resume at step {plan.step + 1}; transfers "
            + (", ".join(f"{d}->{r}" for d, r in transfers) or "none"),
            step=plan.step,
            transfers=transfers,
            committed=dict(sorted((str(k), v) for k, v in rec.reports.items())),
        )
        for x in self.ranks.values():
            if x.alive():
                self.send(x, MsgType.RECONFIGURE, generation=rec.generation, world_size=self.spec.worker_num, step=plan.step, transfers=transfers)

    def replica_groups(self) -> list[list[int]]:
        """The job's replica groups, as the ranks declared them in their hello.

        Raises:
            ValueError: the declarations are not a partition of the ranks.
        """
        declared = {x.rank: list(x.replica_group) for x in self.ranks.values() if x.replica_group}
        if not declared:
            return default_replica_groups(self.spec.worker_num)
        return replica_groups_from_hello(self.spec.worker_num, declared)

    def on_recovered(self, r: Rank, msg: Message) -> None:
        rec = self.recovery
        if rec is None or msg["generation"] != rec.generation or rec.plan is None:
            return
        rec.recovered[r.rank] = dict(msg.fields, at=self.clock())
        r.state = RankState.HEALTHY
        role = msg["role"]
        if role != "none":
            self.emit(
                EventKind.RANK_RECOVERED,
                f"rank {r.rank} rejoined as {role}: {msg['bytes'] / 1e6:.2f} MB in {msg['seconds']:.3f} s",
                rank=r.rank,
                role=role,
                bytes=msg["bytes"],
                seconds=msg["seconds"],
                rebuild_seconds=msg.get("rebuild_seconds"),
            )
        if set(rec.recovered) >= {x.rank for x in self.ranks.values() if x.alive()}:
            now = self.clock()
            total_bytes = sum(int(v["bytes"]) for v in rec.recovered.values() if v["role"] == "recipient")
            transfer_s = max((float(v["seconds"]) for v in rec.recovered.values()), default=0.0)
            # Survivors wait inside the rebuild for the new rank; the last rank to arrive measures
            # the rebuild itself.
            rebuild_s = min((float(v.get("rebuild_seconds") or 0.0) for v in rec.recovered.values()), default=0.0)
            # Respawn: from the spawn to the new rank starting its rebuild (process start, imports,
            # the script's own set-up).
            respawn_s = {}
            for rank, t in rec.respawned_at.items():
                v = rec.recovered.get(rank, {})
                ready = float(v.get("at", now)) - float(v.get("rebuild_seconds") or 0.0) - float(v.get("seconds", 0.0))
                respawn_s[str(rank)] = round(ready - t, 3)
            self.emit(
                EventKind.RECOVERY_FINISHED,
                (f"recovered rank(s) {sorted(rec.failed)}" if rec.failed else "repaired in place")
                + f" in {now - rec.started_at:.2f} s (detection "
                f"{rec.detection_seconds:.3f} s, respawn {max(map(float, respawn_s.values()), default=0.0):.2f} s, "
                f"group rebuild {rebuild_s:.2f} s, transfer {transfer_s:.3f} s): resuming at step {rec.plan.step + 1}, "
                f"{total_bytes / 1e6:.2f} MB transferred",
                failed=sorted(rec.failed),
                resume_step=rec.plan.step + 1,
                total_seconds=round(now - rec.started_at, 3),
                detection_seconds=round(rec.detection_seconds, 4),
                respawn_seconds=respawn_s,
                rebuild_seconds=round(rebuild_s, 3),
                transfer_seconds=round(transfer_s, 3),
                bytes=total_bytes,
                rounds=rec.rounds,
            )
            self.recovery = None
            self.round_failures = []
            for x in self.ranks.values():
                x.last_progress, x.phase = now, "compute"

    # ----------------------------------------------------------------- watchdog
    def step_timeout(self) -> float:
        """Seconds without progress after which the job is hung: ``--step_timeout``, else
        max(step_timeout_min, largest step after warm-up x step_timeout_factor), else (still
        warming up) ``--setup_timeout``."""
        spec = self.spec
        if spec.step_timeout > 0:
            return spec.step_timeout
        if self.max_step_time is None:
            return spec.setup_timeout
        return max(spec.step_timeout_min, self.max_step_time * spec.step_timeout_factor)

    def check_hangs(self) -> None:
        """The watchdog: heartbeats, set-up time, and step progress (NVRx's and torchrun's idea of
        a rank that is alive but not progressing). Acts on the first hang it finds."""
        spec = self.spec
        now = self.clock()
        if self._unrepaired is not None and (self.recovery is not None or self.round_failures):
            self._unrepaired = None  # a death explains it; ARF or the restart policy handles that
        if self._unrepaired is not None and now - self._unrepaired[0] > UNREPAIRED_GRACE_S:
            reason, self._unrepaired = self._unrepaired[1], None
            self._pending_exit = self.restart_job(reason)
            return
        for r in self.ranks.values():
            if not r.alive() or r.kill_reason is not None or r.finished:
                continue  # after ft.finish() the rank sends nothing: its own code runs to its exit
            if r.identity is not None and now - r.last_heartbeat > spec.heartbeat_timeout:
                r.hung_since = r.last_heartbeat
                self.declare_hung(r, "no_heartbeat", f"no heartbeat for {now - r.last_heartbeat:.1f} s (--heartbeat_timeout {spec.heartbeat_timeout:g})")
                return
        for r in self.ranks.values():
            if (r.alive() and r.kill_reason is None and r.section is not None and r.section_timeout is not None
                    and now - r.section_started > r.section_timeout):
                r.hung_since = r.section_started
                self.declare_hung(r, "section", f"in section {r.section!r} for {now - r.section_started:.1f} s "
                                                f"(its timeout {r.section_timeout:g} s)")
                return
        if self.check_stalls(now) or self.check_setup(now) or self.check_round_deadline(now):
            return
        if self.recovery is not None or any(r.alive() and r.kill_reason is not None for r in self.ranks.values()):
            return  # recovering ranks wait for each other (set-up and heartbeats still apply); or a kill is pending
        live = [r for r in self.ranks.values() if r.alive() and r.library and r.step is not None and not r.steps_ended]
        if not live:
            return
        timeout = self.step_timeout()
        last = max(r.last_progress for r in live)
        if now - last <= timeout:
            return
        stalled = f"no step progress for {now - last:.1f} s (step timeout {timeout:.1f} s)"
        # The culprit is the rank not waiting for its peers: one that never announced the
        # collective, or one whose heartbeat thread sees it outside torch.distributed although it
        # announced it (stuck in its own code between the announcement and the call).
        culprits = [r for r in live if r.phase != "collective" or r.in_dist is False]
        if culprits:
            for r in culprits:
                r.hung_since = last
                where = "outside the collective it announced" if r.phase == "collective" else f"({r.phase})"
                waiting = [x.rank for x in live if x is not r and x.in_dist is True]
                peers = (f"while rank(s) {waiting} wait in torch.distributed" if waiting
                         else "while its peers wait for it" if len(culprits) < len(live) else "like every rank")
                self.declare_hung(r, "no_progress", f"{stalled}; rank {r.rank} stuck at step {r.step} {where} {peers}")
            return
        reason = f"{stalled}; every rank waits in the collective of step {max(r.step or 0 for r in live)}"
        self.emit(EventKind.WARNING, f"communication hang: {reason}", fault="comm_hang")
        if spec.tft.hcce and spec.tft.arf:
            self.start_recovery(set(), reason, kind="comm_error")
        else:
            self._pending_exit = self.restart_job(f"communication hang ({reason}) and HCCE is off")

    def stall_bound(self, r: Rank) -> float:
        """Seconds a rank may spend in its own code during a stage that its peers wait on (a
        recovery's drop and transfer, the initial broadcast): a few heartbeats, plus the time to
        copy the bytes that stage moves at a rate far below memory speed."""
        return max(STALL_BASE_S, 3 * self.spec.heartbeat_interval) + r.stage_bytes / STALL_MIN_BYTES_PER_S

    def check_stalls(self, now: float) -> bool:
        """A rank stuck in its own code during a recovery's drop or transfer, or before the initial
        broadcast, while a peer waits for it inside torch.distributed (the peers say so: their
        heartbeats see them there), is hung after :meth:`stall_bound` seconds, whatever the
        round's or the set-up's longer deadlines (round 3: a hang at ``rejoin`` held the job until
        the 300 s set-up timeout, at ``transfer`` for 60-150 s). True when it acted."""
        alive = [r for r in self.ranks.values() if r.alive() and r.identity is not None and r.kill_reason is None
                 and not r.finished]
        waiting = [r.rank for r in alive if r.in_dist is True]
        acted = False
        for r in alive:
            if r.stage not in STALL_STAGES or r.outside_since is None:
                continue
            stalled, bound = now - r.outside_since, self.stall_bound(r)
            others = [w for w in waiting if w != r.rank]
            if stalled > bound and others:
                r.hung_since = r.outside_since
                self.declare_hung(r, "stalled", f"rank {r.rank} stuck in its own code for {stalled:.1f} s during "
                                                f"{STALL_STAGES[r.stage]} (bound {bound:.1f} s) while rank(s) {others} "
                                                "wait for it in torch.distributed")
                acted = True
        return acted

    def check_setup(self, now: float) -> bool:
        """Ranks that have not begun a step ``--setup_timeout`` seconds after their start. Only
        those not waiting in a torch.distributed call (the initial broadcast, a rendezvous) are
        hung: the others wait for them. True when it acted."""
        spec = self.spec
        if self.recovery is not None and now - self.recovery.round_started < REPORT_DEADLINE_S:
            return False  # ranks released by the abort (a failed broadcast) get the time to report
        overdue = [r for r in self.ranks.values() if r.alive() and r.kill_reason is None and not r.finished and r.library
                   and r.step is None and not r.steps_ended and now - r.started_at > spec.setup_timeout
                   and r.phase == "setup"  # one that reported a fault is in a recovery round: its deadlines apply
                   and r.node in self.agents]  # a rank whose node has not (re)joined is not started yet
        if not overdue:
            return False
        culprits = [r for r in overdue if r.in_dist is not True]
        if not culprits:
            waiting = [r for r in self.ranks.values() if r.alive() and r.in_dist is True]
            if len(waiting) < len([r for r in self.ranks.values() if r.alive()]):
                return False  # someone not yet overdue is what they wait for: its own timeout comes
            culprits = overdue  # every rank waits in a collective: nobody else can be blamed
        for r in culprits:
            r.hung_since = r.started_at
            self.declare_hung(r, "setup", f"no step begun {now - r.started_at:.0f} s after start (--setup_timeout {spec.setup_timeout:g})"
                              + ("" if r.in_dist is None else "; not waiting for its peers"))
        return True

    def check_round_deadline(self, now: float) -> bool:
        """Every recovery round has a deadline: a connected rank that has not answered the abort
        within :data:`REPORT_DEADLINE_S`, or has not carried out the plan within
        :data:`PLAN_DEADLINE_S` while not waiting in torch.distributed, is hung and replaced,
        never waited for (a rank stuck in its own code inside a collective, or during a transfer).
        True when it acted."""
        rec = self.recovery
        if rec is None:
            return False
        # A rank still in its set-up (a respawned one, connected but not yet at its loop) reads no
        # message before its loop: --setup_timeout bounds it, not these deadlines.
        live = [r for r in self.ranks.values()
                if r.alive() and r.identity is not None and r.kill_reason is None and r.phase != "setup"]
        if rec.plan is None:
            if now - rec.round_started <= REPORT_DEADLINE_S:
                return False
            # A rank blocked in torch.distributed is released by the abort (its connections cut)
            # and answers; it gets the plan's longer bound before it is taken for hung.
            waited = now - rec.round_started
            late = [r for r in live if r.rank not in rec.reports and (r.in_dist is not True or waited > PLAN_DEADLINE_S)]
            what = f"did not answer the abort of generation {rec.generation} within {waited:.0f} s"
        else:
            if now - rec.planned_at <= PLAN_DEADLINE_S:
                return False
            late = [r for r in live if r.rank not in rec.recovered and r.in_dist is not True]
            what = f"did not carry out the plan of generation {rec.generation} within {PLAN_DEADLINE_S:g} s"
        for r in late:
            r.hung_since = rec.round_started if rec.plan is None else rec.planned_at
            self.declare_hung(r, "recovery", f"rank {r.rank} {what}")
        return bool(late)

    def declare_hung(self, r: Rank, kind: str, evidence: str) -> None:
        """Have the rank's agent dump its stacks into its log and SIGKILL it (then it is recovered
        as a death); the ``rank_hung`` event follows, with the stacks, when the agent reports."""
        r.kill_reason = f"hung: {evidence}"
        self._hung[(r.rank, r.incarnation)] = (kind, evidence, r.step, r.phase,
                                               round(self.clock() - r.last_heartbeat, 3) if r.identity is not None else None)
        agent = self.agents.get(r.node)
        if agent is not None:
            # Only the worker library installs the SIGUSR1 stack dump; SIGUSR1 would kill any other script.
            agent.kill_hung(r.rank, r.incarnation,
                            f"===== ftrun: rank {r.rank} (pid {r.pid}) hung: {evidence}; {{note}}; killing it =====",
                            dump=r.library)

    def on_stacks(self, r: Rank, report: Stacks) -> None:
        kind, evidence, step, phase, heartbeat_age = self._hung.pop((r.rank, report.incarnation), ("unknown", "", r.step, r.phase, None))
        where = self.log_dir / f"worker_{r.rank}.log"
        self.emit(
            EventKind.RANK_HUNG,
            f"rank {r.rank} hung: {evidence}; {report.note}",
            rank=r.rank,
            fault=kind,
            evidence=evidence,
            step=step,
            phase=phase,
            heartbeat_age=heartbeat_age,
            stack_dump=(str(where) + (f" on node {r.node}" if r.node else "")) if report.lines else None,
            stacks=report.lines[-80:],
        )

    # ----------------------------------------------------------------- messages
    def send(self, r: Rank, msg_type: MsgType, **fields: Any) -> None:
        if r.identity is None:
            return  # not connected yet: it will get the current state when it says hello
        self.router.send_multipart([r.identity, encode(msg_type, self.sender, to_peer(r.identity), **fields)])

    def read_messages(self, budget: int = READ_BUDGET, agents_only: bool = False) -> None:
        """Handle up to ``budget`` frames waiting on the ROUTER (with ``agents_only``, ranks'
        messages are dropped: while every rank is being stopped).

        The budget bounds the time one call takes whatever arrives (a flood of forged frames), so
        the loop gets back to reaping deaths (SIGCHLD) and to the watchdog between batches.
        """
        for _ in range(budget):
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [part.bytes for part in parts]
            identity = frames[0]
            if identity in self._offenders:
                continue  # dropped unread: no MAC, no decode, no log
            if len(frames) != 2:
                self.reject(identity, "wrong number of frames")
                continue
            try:
                msg = decode(frames[1], self.receiver)
            except ProtocolError as err:
                self.reject(identity, str(err))
                continue
            if msg.type in AGENT_MESSAGES:
                self.on_agent_message(identity, msg, fd=parts[1].get(zmq.SRCFD) if msg.type == MsgType.AGENT_HELLO else None)
            elif not agents_only:
                self.handle(identity, msg)
            if self._pending_exit is not None:
                return

    def reject(self, identity: bytes, why: str) -> None:
        """Count a rejected frame; log and emit only the first few, and drop a connection's frames
        unread once it has sent :data:`OFFENDER_REJECTS` bad ones (a flood costs almost nothing)."""
        self.rejected += 1
        per_peer = self._reject_counts[identity] = self._reject_counts.get(identity, 0) + 1
        if per_peer >= OFFENDER_REJECTS and identity not in {r.identity for r in self.ranks.values()}:
            self._offenders.add(identity)
            self._reject_counts.pop(identity, None)
            if len(self._offenders) <= MAX_REJECT_EVENTS:
                log.warning("dropping every further frame from connection %r (%d rejected)", identity[:16], per_peer)
        if len(self._reject_counts) > 10_000:
            self._reject_counts.clear()
        if self.rejected <= MAX_REJECT_EVENTS:
            log.warning("rejected message from %r: %s", identity[:32], why)
            self.emit(EventKind.MESSAGE_REJECTED, f"rejected a control message: {why}", reason=why, total=self.rejected)
        elif self.rejected in (MAX_REJECT_EVENTS + 1, 1000, 100_000) or self.rejected % 1_000_000 == 0:
            log.warning("%d control messages rejected so far (only the first %d are logged one by one)",
                        self.rejected, MAX_REJECT_EVENTS)

    def handle(self, identity: bytes, msg: Message) -> None:
        """Route one authenticated message of a rank to its handler (:attr:`_rank_handlers`).

        A message must name a live rank and its current incarnation; every message but ``hello``
        must come from the connection whose ``hello`` was accepted for that incarnation.
        """
        r = self.ranks.get(msg.get("rank")) if "rank" in msg.fields else None
        if r is None or msg.get("incarnation") != r.incarnation or not r.alive():
            self.reject(identity, f"{msg.type.value} for a rank/incarnation that is not live here")
            return
        if msg.type == MsgType.HELLO:
            self.on_hello(identity, r, msg)
            return
        if identity != r.identity:
            self.reject(identity, f"{msg.type.value} for rank {r.rank} from a connection that did not say hello")
            return
        r.last_heartbeat = self.clock()
        handler = self._rank_handlers.get(msg.type)
        if handler is not None:
            handler(self, r, msg)

    def on_hello(self, identity: bytes, r: Rank, msg: Message) -> None:
        """A rank's process connects: bind the rank to this connection; during a recovery its
        hello is its report (it holds no state) or it is told the recovery's generation."""
        if r.pid is None:
            r.pid = msg["pid"]  # its node's agent has not reported the spawn yet
        elif msg["pid"] != r.pid:
            self.reject(identity, f"hello for rank {r.rank} from pid {msg['pid']}, expected {r.pid}")
            return
        r.identity = identity
        r.library = bool(msg["library"])
        r.replica_group = tuple(int(x) for x in msg["replica_group"])
        r.last_heartbeat = self.clock()
        r.state = RankState.HEALTHY if self.recovery is None else RankState.RECOVERING
        self.emit(EventKind.RANK_JOINED, f"rank {r.rank} connected (pid {r.pid})", rank=r.rank, library=r.library)
        hot = msg.get("hot")
        if isinstance(hot, str) and hot != "the training loop":
            # A hot spare promoted while its script waited for its rank in its set-up: correct, but
            # only as fast as a warm spare (docs/hot_spares.md).
            self.emit(EventKind.WARNING,
                      f"rank {r.rank}: its hot spare was still in the script's set-up, waiting on {hot[:80]} (the "
                      "script reads its rank before its training loop); it finished the set-up after its promotion, "
                      "as a warm spare does (docs/hot_spares.md)", rank=r.rank, fault="hot_spare_contract")
        if self.recovery is not None:
            self.recovery.joined_at.setdefault(r.rank, self.clock())
            if msg["generation"] != self.recovery.generation:
                self.send(r, MsgType.ABORT, generation=self.recovery.generation, reason="recovery in progress")
            else:
                self.on_report(r, msg["generation"], NO_STATE)

    def on_heartbeat(self, r: Rank, msg: Message) -> None:
        """Liveness (recorded for every message by :meth:`handle`), and the heartbeat thread's
        evidence: whether the training thread waits inside a torch.distributed call."""
        in_dist = msg.get("in_dist")
        r.in_dist = in_dist if isinstance(in_dist, bool) else None
        stage, nbytes = msg.get("stage"), msg.get("stage_bytes")
        if isinstance(stage, str):
            stage = stage[:20]
            if r.in_dist is not False:
                r.outside_since = None
            elif r.outside_since is None or stage != r.stage:
                r.outside_since = self.clock()
            r.stage = stage
            r.stage_bytes = nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes > 0 else 0

    def on_step(self, r: Rank, msg: Message) -> None:
        """``step_begin`` or ``progress``: the rank's step (and metrics) moved."""
        now = self.clock()
        r.step = msg["step"]
        r.last_progress = now
        if msg.type == MsgType.PROGRESS:
            r.metrics = {str(k): v for k, v in msg["metrics"].items() if isinstance(v, (int, float, str))}
            if "section" in msg.fields:
                self.on_section(r, msg.get("section"), msg.get("section_timeout"), now)
        else:
            self.observe_step(r, msg["step"], now)
            total = msg.get("total")
            r.total_steps = total if isinstance(total, int) and not isinstance(total, bool) else r.total_steps
        self._status_dirty = True

    def on_section(self, r: Rank, name: Any, timeout: Any, now: float) -> None:
        """A rank opens, keeps or closes a named section (``ft.section()``: an evaluation, a
        checkpoint write) whose own bound replaces the step watchdog's while it is open (NVRx's
        sections). Step intervals that span a section are not samples of the step time."""
        if isinstance(name, str) and name:
            if r.section != name:
                r.section, r.section_started = name[:100], now
            r.section_timeout = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0 else None
        elif name is None and r.section is not None:
            r.section, r.section_timeout, r.section_closed_at = None, None, now

    def on_phase(self, r: Rank, msg: Message) -> None:
        """``collective`` or ``update_begin``: where in the step the rank is (for the watchdog);
        the time from its step's start to the collective is its own compute time (stragglers)."""
        now = self.clock()
        if msg.type == MsgType.COLLECTIVE and r.last_begin is not None and r.phase == "compute":
            r.compute_seconds = now - r.last_begin[1]
        r.phase, r.last_progress = ("collective" if msg.type == MsgType.COLLECTIVE else "update"), now

    def on_update_end(self, r: Rank, msg: Message) -> None:
        """The step's optimizer update finished: that step is committed on this rank."""
        r.committed = msg["step"]
        r.phase, r.last_progress = "compute", self.clock()

    def on_steps_end(self, r: Rank, msg: Message) -> None:
        """The rank left its step loop: no step watchdog for it from here on."""
        r.steps_ended, r.phase = True, "done"

    def on_fault_message(self, r: Rank, msg: Message) -> None:
        """A failed collective, a recoverable error, or the answer to an abort (a dying gasp's
        report while one runs)."""
        r.committed = msg["committed"]
        r.phase = "recovering"
        if self._gasp is not None:
            if msg["generation"] == self._gasp["generation"]:
                self._gasp["reports"][r.rank] = msg["committed"]
            return
        self.on_fault(r, msg)

    def on_saved(self, r: Rank, msg: Message) -> None:
        """A shard file was written (dying gasp or periodic checkpoint)."""
        if self._gasp is not None and msg["step"] == self._gasp.get("step"):
            self._gasp["saved"][msg["shard"]] = msg
        elif msg["reason"] == "periodic":
            self.on_periodic_save(msg)

    def on_error(self, r: Rank, msg: Message) -> None:
        """A rank reports a problem it survived (e.g. a shard it could not write)."""
        self.emit(EventKind.WARNING, f"rank {r.rank} reported: {msg['reason']}", rank=r.rank)
        if self._gasp is not None and r.rank in self._gasp.get("writers", {}).values():
            self._gasp["failed"] = f"rank {r.rank}: {msg['reason']}"

    def on_done(self, r: Rank, msg: Message) -> None:
        """A rank says it called ``ft.finish()``: a claim, never the job's end.

        The job ends when every rank's *process* has exited (code after ``finish()`` -- saving the
        model, writing metrics -- runs, as under torchrun). The claim is checked: ranks that
        finished at different committed steps are named in a warning (a diverged job).
        """
        r.steps_ended, r.phase, r.finished = True, "done", True
        committed = msg.get("committed")
        if isinstance(committed, int) and not isinstance(committed, bool):
            r.final_step = committed
            claims = {x.rank: x.final_step for x in self.ranks.values() if x.final_step is not None}
            if len(set(claims.values())) > 1:
                self.emit(EventKind.WARNING, f"ranks finished at different committed steps: {claims}", claims=claims)
        self.release_finish_barrier()

    def release_finish_barrier(self) -> None:
        """Once every rank has finished (said ``done``, or exited 0), let the ranks waiting in
        ``ft.finish()`` go. Until then they keep their final state for a rank that dies in its
        epilogue (it is respawned and recovers from them like any other)."""
        if self.recovery is not None or not all(x.finished or x.state == RankState.SUCCEEDED for x in self.ranks.values()):
            return
        for x in self.ranks.values():
            if x.finished and x.alive() and x.identity is not None and not x.released:
                x.released = True
                self.send(x, MsgType.FINISHED)

    def on_divergence(self, r: Rank, msg: Message) -> None:
        """A rank found that exactly-once does not hold (issue 20): a step it recomputed gave
        another local gradient than the first computation (state the script carries outside what
        ftrun restores), or replicas hold other parameters after a recovery. A ``divergence``
        event and a console warning; with ``--on_divergence fail`` the job stops with a
        dying-gasp checkpoint of the last step every rank committed (the rank holds its
        diverged step back until the abort)."""
        step, check = msg["step"], msg["check"]
        fail = self.spec.on_divergence == "fail"
        self.emit(EventKind.DIVERGENCE, f"rank {r.rank} diverged at step {step} ({check}): {msg['reason'][:600]}"
                  + ("; stopping (--on_divergence fail)" if fail else ""), rank=r.rank, step=step, check=check,
                  reason=msg["reason"][:1000])
        if fail and self._pending_exit is None and self._gasp is None:
            self._pending_exit = self.stop(DIVERGENCE_EXIT_CODE, f"stopped: rank {r.rank} diverged at step {step} "
                                           "(--on_divergence fail)")

    _rank_handlers: dict[MsgType, Callable[["Coordinator", Rank, Message], None]] = {
        MsgType.HEARTBEAT: on_heartbeat,
        MsgType.STEP_BEGIN: on_step,
        MsgType.PROGRESS: on_step,
        MsgType.COLLECTIVE: on_phase,
        MsgType.UPDATE_BEGIN: on_phase,
        MsgType.UPDATE_END: on_update_end,
        MsgType.STEPS_END: on_steps_end,
        MsgType.FAULT: on_fault_message,
        MsgType.SAVED: on_saved,
        MsgType.RECOVERED: lambda self, r, msg: self.on_recovered(r, msg),
        MsgType.DONE: lambda self, r, msg: self.on_done(r, msg),
        MsgType.ERROR: on_error,
        MsgType.DIVERGENCE: on_divergence,
    }

    # ----------------------------------------------------------------- checkpoints (TTP)
    def on_periodic_save(self, msg: Message) -> None:
        """A shard of a periodic checkpoint is written; once every shard is, write the manifest."""
        try:
            groups = self.replica_groups()
        except ValueError:
            return
        saves = self.pending_saves.setdefault(msg["step"], {})
        saves[msg["shard"]] = msg
        if len(saves) < len(groups):
            return
        del self.pending_saves[msg["step"]]
        for old in [s for s in self.pending_saves if s < msg["step"]]:
            del self.pending_saves[old]  # a shard of it never came: that checkpoint stays incomplete
        self.complete_checkpoint(msg["step"], groups, saves, "periodic")

    def complete_checkpoint(self, step: int, groups: list[list[int]], saves: dict[int, Message], reason: str) -> None:
        directory = ckpt.step_dir(self.checkpoint_root, step)
        try:
            ckpt.write_manifest(
                directory, step, self.spec.worker_num, groups, {k: m["info"] for k, m in saves.items()},
                reason=reason, torch_version=next(iter(saves.values()))["torch_version"],
            )
            removed = ckpt.prune(self.checkpoint_root, self.spec.keep_checkpoints) if self.spec.keep_checkpoints else []
        except (OSError, ckpt.CheckpointError) as err:
            self.emit(EventKind.WARNING, f"checkpoint of step {step} not completed: {err}", step=step)
            return
        nbytes = sum(int(m["info"]["bytes"]) for m in saves.values())
        seconds = max(float(m["seconds"]) for m in saves.values())
        self.emit(
            EventKind.CHECKPOINT_SAVED,
            f"checkpoint of step {step} written ({reason}): {nbytes / 1e6:.2f} MB in {seconds:.2f} s, {directory}",
            step=step,
            bytes=nbytes,
            seconds=round(seconds, 3),
            path=str(directory),
            reason=reason,
            pruned=[str(p) for p in removed],
        )

    def resume_hint(self) -> str:
        """'; newest checkpoint: ...' for a failure summary, or '' when there is none."""
        if not self.spec.tft.ttp:
            return ""
        newest = ckpt.find_latest(self.checkpoint_root, on_skip=lambda *_: None, checksums=False)
        if newest is None:
            return ""
        return f"; newest checkpoint: step {newest.step} in {newest.directory} (the same command resumes from it)"

    def dying_gasp(self, reason: str) -> None:
        """TTP: have one live replica of each shard write the newest step every shard committed.

        Live ranks are aborted (a new generation) so that each stops at a safe point (its group
        down, its state exactly its committed step) and reports that step; the step S is chosen as
        for a recovery; the lowest-ranked replica holding S writes each shard; the manifest is
        written once every shard is in. A shard without a live replica holding S means no
        checkpoint at all (never a partial one), said in an event.
        """
        spec = self.spec
        live = [r for r in self.ranks.values() if r.alive() and r.library and r.identity is not None and r.kill_reason is None]
        if not spec.tft.ttp or not live:
            return
        started = self.clock()
        self.recovery = None
        self.generation += 1
        gasp: dict[str, Any] = {"generation": self.generation, "reports": {}, "saved": {}, "writers": {}}
        self._gasp = gasp
        try:
            for r in live:
                self.send(r, MsgType.ABORT, generation=self.generation, reason=f"saving a dying-gasp checkpoint: {reason}")
            self._pump(lambda: set(gasp["reports"]) >= {r.rank for r in live if r.alive()}, self.ttp_report_wait)
            reports = {rank: c for rank, c in gasp["reports"].items() if self.ranks[rank].alive()}
            try:
                groups = self.replica_groups()
                plan = plan_recovery(reports, groups)
            except (NoLiveReplica, ValueError) as err:
                self.emit(EventKind.WARNING, f"TTP: no dying-gasp checkpoint, nothing written: {err}", reason=str(err))
                return
            step = plan.step
            if step < 0:
                return  # nothing committed yet: nothing to keep
            newest = ckpt.find_latest(self.checkpoint_root, on_skip=lambda *_: None, checksums=False)
            if newest is not None and newest.step >= step:
                self.emit(EventKind.WARNING, f"TTP: step {step} is already in checkpoint {newest.directory}; nothing to write")
                return
            groups = ckpt.canonical_groups(groups)
            writers = {k: min(r for r in g if reports.get(r) == step) for k, g in enumerate(groups)}
            gasp.update(step=step, writers=writers)
            directory = ckpt.step_dir(self.checkpoint_root, step)
            for shard, rank in writers.items():
                self.send(self.ranks[rank], MsgType.SAVE, generation=self.generation, step=step, shard=shard,
                          directory=str(directory), reason="dying gasp")
            self._pump(lambda: len(gasp["saved"]) == len(writers) or "failed" in gasp
                       or not all(self.ranks[w].alive() for w in writers.values()), TTP_WRITE_WAIT_S)
            if len(gasp["saved"]) < len(writers):
                missing = sorted(set(writers) - set(gasp["saved"]))
                why = gasp.get("failed") or f"shard(s) {missing} not written"
                self.emit(EventKind.WARNING, f"TTP: dying-gasp checkpoint of step {step} incomplete ({why}); not completed")
                return
            self.complete_checkpoint(step, groups, gasp["saved"], f"dying gasp ({reason})")
            log.info("dying gasp took %.2f s", self.clock() - started)
        finally:
            self._gasp = None

    def _pump(self, done: Any, timeout: float) -> None:
        """Handle control messages until ``done()`` or ``timeout`` seconds (a dying gasp)."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if self.router.poll(timeout=100):
                self.read_messages()
            for r in self.collect_reports():  # deaths during a dying gasp: recorded, not recovered
                log.info("rank %d died during the dying gasp", r.rank)

    def observe_step(self, r: Rank, step: int, now: float) -> None:
        """Record the time of the step before ``step`` (for the automatic step timeout)."""
        if r.last_begin is not None and r.last_begin[0] == step - 1 and r.last_begin[1] >= r.section_closed_at:
            r.samples += 1
            r.last_step_seconds = now - r.last_begin[1]
            if r.samples > self.spec.warmup_steps:
                self.max_step_time = max(self.max_step_time or 0.0, now - r.last_begin[1])
        r.last_begin = (step, now)
        r.phase = "compute"

    def on_fault(self, r: Rank, msg: Message) -> None:
        """A rank reports a failed collective, a recoverable error, or its answer to an abort."""
        rec = self.recovery
        kind = msg.get("kind", "comm")
        if rec is not None and rec.plan is not None and msg["generation"] == rec.generation and kind == "abort":
            # An answer to this round's abort arriving after its plan: the rank's report was already
            # counted (a UCE rank's own report is its answer). Not a failure.
            return
        if rec is not None and rec.plan is not None and msg["generation"] == rec.generation and self.spec.tft.arf:
            # The plan itself failed (a transfer or the new group broke) with no death seen: next round.
            self.start_recovery(set(), f"rank {r.rank} could not carry out the plan: {msg['reason']}", kind="comm_error")
        elif rec is not None:
            self.on_report(r, msg["generation"], msg["committed"])
        elif msg["generation"] == self.generation and kind in ("comm", "recoverable"):
            # No rank died (yet): repair in place, no respawn. UCE: the rank reloads from a replica.
            event_kind = "recoverable_error" if kind == "recoverable" else "comm_error"
            allowed = self.spec.tft.arf and (self.spec.tft.uce if kind == "recoverable" else self.spec.tft.hcce)
            reason = f"rank {r.rank} reported {msg['reason']}"
            if not allowed:
                # A collective also fails when a peer dies, and its report can beat the peer's
                # SIGCHLD: wait a moment for a death before restarting the whole job.
                switch = "UCE" if kind == "recoverable" else "HCCE"
                if self._unrepaired is None:
                    self._unrepaired = (self.clock(), f"{reason} and {switch} is off")
                return
            self.start_recovery(set(), reason, kind=event_kind)
            self.on_report(r, self.generation, msg["committed"])

    def close(self) -> None:
        self.router.disable_monitor()
        self.disconnects.close(0)
        self.router.close(0)
        if self.push is not None:
            self.push.close(2000)
        self.ctx.term()


def write_status_file(path: Path, snapshot: dict[str, Any]) -> None:
    """Replace ``path`` with ``snapshot`` as JSON, atomically (a reader never sees half a file)."""
    import json

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(snapshot, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot write %s: %s", path, err)


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)

"""The supervisor: spawns and owns the ranks of one node, watches them, and recovers.

It plays MindCluster's ``reset_process`` role. It is a child of the launcher (``python -m
ftrun.supervisor``), reads its :class:`~ftrun.config.JobSpec` from the environment, and:

- spawns each rank with torchrun's and msrun's environment contract, in its own session, tied to the
  supervisor's life (``PR_SET_PDEATHSIG``), its output appended to ``LOG_DIR/worker_<rank>.log``;
- sees a rank's death at once (``SIGCHLD`` wakes its poll loop), because it is the parent;
- binds the ZeroMQ ROUTER the ranks report health to (hello, heartbeat, step, update, fault...);
  frames without the job secret or not matching a live rank's identity are dropped and logged;
- applies :mod:`ftrun.policy`: respawn only the failed rank and orchestrate the state transfer
  (ARF), restart the whole job (torchrun semantics), or fail with the root cause's exit code;
- watches for hangs (the watchdog): a rank whose heartbeats stop (frozen), a job whose steps stop
  advancing (a deadlock, an endless loop, a stuck collective), a rank that never reaches its first
  step; it asks a hung rank for its Python stacks (faulthandler), writes them to its log and an
  event, kills it and recovers as for a death; a collective stuck on every rank is rebuilt (HCCE);
- repairs in place, without a respawn, a communication error (HCCE) or a recoverable error (UCE)
  that a rank reports;
- keeps the training state when it cannot repair (TTP): before a whole-job restart, a failure with
  the budget used up, or a stop by SIGTERM/SIGINT, it has one live replica of each shard write the
  newest step every shard committed (a *dying-gasp* checkpoint), completes periodic checkpoints
  (``--save_steps``) with their manifest, and starts every attempt from the newest complete
  checkpoint (``--resume``);
- hosts, on node 0, a fresh c10d ``TCPStore`` for every whole-job attempt (so a restarted job never
  meets a previous attempt's keys; the ranks' process groups rendezvous on it);
- records every event in ``LOG_DIR/events.jsonl`` and pushes events and status snapshots to the
  launcher, which draws the console.

Its exit code is the job's: 0, the root-cause rank's exit code (128+N for signal N), or 130/143 when
stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from . import checkpoint as ckpt
from . import procs
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
from .protocol import MAX_FRAME_BYTES, FrameAuth, Message, MsgType, ProtocolError, decode, encode

log = logging.getLogger("ftrun.supervisor")

STATUS_PERIOD_S = 0.25  # at most four console snapshots a second
STACK_DUMP_WAIT_S = 2.0  # how long a hung rank gets to write its stacks before it is killed
UNREPAIRED_GRACE_S = 1.0  # wait this long for a death to explain a failed collective before restarting
TTP_REPORT_WAIT_S = 10.0  # how long live ranks get to reach a safe point and report (dying gasp)
TTP_WRITE_WAIT_S = 300.0  # how long the shard writers get to write (dying gasp)
_KIND_LABEL = {"comm_error": "HCCE: communication error", "recoverable_error": "UCE: recoverable error"}
MAX_REJECT_EVENTS = 20  # rejected frames after this many are counted in the log only
OFFENDER_REJECTS = 8  # a connection that sent this many rejected frames is not read any more
READ_BUDGET = 2000  # frames handled per pass of the main loop (then deaths and hangs are checked)


@dataclass
class Rank:
    """One rank served by this node, and the process serving it now (cf. torchelastic's Worker)."""

    rank: int
    local_rank: int
    incarnation: int = -1
    proc: subprocess.Popen | None = None
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

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
            "uptime": (now - self.started_at) if self.proc is not None and self.exit_code is None else None,
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


class Supervisor:
    """Owns this node's ranks for the whole job. ``run()`` returns the job's exit code."""

    def __init__(self, spec: JobSpec, token: str, events_addr: str | None, store_port: int) -> None:
        self.spec = spec
        self.token = token  # handed to the ranks in their environment; never sent on a socket
        self.auth = FrameAuth(token)
        self.store_port = store_port
        self.log_dir = Path(spec.log_dir)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a second connection presenting a connected rank's identity is
        # refused, never given that rank's traffic. Oversized frames are dropped by ZeroMQ before
        # they are buffered (the connection that sent one is closed).
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.control_addr = f"tcp://127.0.0.1:{port}"
        self.push: zmq.Socket | None = None
        if events_addr:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 2000)
            self.push.setsockopt(zmq.SNDHWM, 100_000)
            self.push.connect(events_addr)
        self.event_log = EventLog(open(self.log_dir / "events.jsonl", "a", encoding="utf-8"))
        self.ranks = {
            spec.global_rank(lr): Rank(rank=spec.global_rank(lr), local_rank=lr) for lr in range(spec.local_worker_num)
        }
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
        self._sigchld_at: float | None = None  # arrival of the first SIGCHLD not yet acted on
        self.max_step_time: float | None = None  # largest step time seen after warm-up (seconds)
        self.checkpoint_root = Path(spec.checkpoint_dir).resolve()
        self.resume_from: ckpt.Manifest | None = None  # the checkpoint this attempt starts from
        self.pending_saves: dict[int, dict[int, Message]] = {}  # step -> shard -> its SAVED report
        self._gasp: dict[str, Any] | None = None  # the dying gasp in progress
        self._unrepaired: tuple[float, str] | None = None  # a fault reported that no switch repairs
        self.spares: list[subprocess.Popen] = []  # warm spares (ftrun.spare), torch imported, idle
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
            node=self.spec.node_rank,
            detail=detail,
        )
        self.event_log.write(event)
        log.info("%s %s", kind.value, message)
        if self.push is not None:
            self.push.send(encode(MsgType.EVENT, self.auth, event=event.to_json()))
        self._status_dirty = True
        return event

    def publish_status(self, force: bool = False) -> None:
        now = time.time()
        if self.push is None or not (force or (self._status_dirty and now - self._last_status >= STATUS_PERIOD_S)):
            return
        ranks = [r.status(now) for r in self.ranks.values()]
        self.push.send(encode(MsgType.STATUS, self.auth, ranks=ranks, attempt=self.attempt, generation=self.generation))
        self._status_dirty = False
        self._last_status = now

    # ----------------------------------------------------------------- stores
    def _attempt_store_port(self) -> int:
        """The port of the store this attempt's ranks rendezvous on (their MASTER_PORT).

        Attempt 0 uses the launcher's store on ``--master_port``, as a torchrun user expects. Every
        later attempt gets a fresh store, hosted here on node 0 and announced to the other nodes
        through the launcher's store, because an unmodified ``env://`` script would otherwise meet
        the keys of the attempt before it (the stale-address failure of torchrun's shared store).
        """
        if self.attempt == 0:
            return self.store_port
        if self.spec.node_rank == 0:
            from .stores import bind_host, serve_store  # imports torch: only a whole-job restart needs it

            self.attempt_store = None  # release the previous attempt's store first
            self.attempt_store, port = serve_store(
                bind_host(self.spec.master_addr, self.spec.nnodes), 0, self.spec.cluster_time_out
            )
            if self.spec.nnodes > 1:
                self._main_store().set(f"ftrun/attempt/{self.attempt}/port", str(port))
            return port
        return int(self._main_store().get(f"ftrun/attempt/{self.attempt}/port").decode())

    def _main_store(self) -> Any:
        if self.main_store is None:
            from torch.distributed import TCPStore

            self.main_store = TCPStore(
                self.spec.master_addr,
                self.store_port,
                is_master=False,
                timeout=_timedelta(self.spec.cluster_time_out),
            )
        return self.main_store

    # ----------------------------------------------------------------- spawning
    def worker_env(self, r: Rank, attempt_port: int) -> dict[str, str]:
        """The environment of one rank: torchrun's and msrun's contract plus ftrun's own variables."""
        spec = self.spec
        env = dict(os.environ)
        for key in ("FTRUN_TOKEN_FOR_SUPERVISOR", "FTRUN_SUPERVISOR_SPEC", "FTRUN_EVENTS_ADDR", "FTRUN_STORE_PORT"):
            env.pop(key, None)
        env.update(
            {
                # torchrun
                "RANK": str(r.rank),
                "LOCAL_RANK": str(r.local_rank),
                "WORLD_SIZE": str(spec.worker_num),
                "LOCAL_WORLD_SIZE": str(spec.local_worker_num),
                "GROUP_RANK": str(spec.node_rank),
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
                "MS_NODE_RANK": str(spec.node_rank),
                "MS_ROLE": "MS_WORKER",
                "MS_SCHED_HOST": spec.master_addr,
                "MS_SCHED_PORT": str(self.store_port),
                "DEVICE_ID": str(r.local_rank),
                # ftrun worker library
                "FTRUN_CONTROL_ADDR": self.control_addr,
                "FTRUN_TOKEN": self.token,
                "FTRUN_INCARNATION": str(r.incarnation),
                "FTRUN_GENERATION": str(self.generation),
                "FTRUN_ATTEMPT": str(self.attempt),
                "FTRUN_HEARTBEAT_INTERVAL": str(spec.heartbeat_interval),
                "FTRUN_PG_TIMEOUT": str(spec.pg_timeout),
                "FTRUN_CLUSTER_TIME_OUT": str(spec.cluster_time_out),
                "FTRUN_ARF": "1" if spec.tft.arf else "0",
                "FTRUN_UCE": "1" if spec.tft.uce else "0",
                "FTRUN_RECOVERABLE_ERRORS": ",".join(spec.recoverable_errors),
                "FTRUN_CHECKPOINT_DIR": str(self.checkpoint_root),
                "FTRUN_SAVE_STEPS": str(spec.save_steps),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.resume_from is not None:
            env["FTRUN_RESUME_DIR"] = str(self.resume_from.directory)
            env["FTRUN_RESUME_STEP"] = str(self.resume_from.step)
        else:
            env.pop("FTRUN_RESUME_DIR", None)
            env.pop("FTRUN_RESUME_STEP", None)
        if spec.local_worker_num > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun does: ranks would oversubscribe the cores
        return env

    def argv(self) -> list[str]:
        spec = self.spec
        if spec.no_python:
            return [spec.script, *spec.script_args]
        if spec.module:
            return [sys.executable, "-u", "-m", spec.script, *spec.script_args]
        return [sys.executable, "-u", spec.script, *spec.script_args]

    def spawn(self, r: Rank, attempt_port: int, use_spare: bool = False) -> None:
        """Start the next incarnation of rank ``r`` (in a warm spare if ``use_spare`` and one is idle)."""
        r.incarnation += 1
        r.identity = None  # r.library stays: a respawned rank runs the same script as before
        r.step = None
        r.committed = NO_STATE
        r.metrics = {}
        r.exit_code = None
        r.exit_desc = ""
        r.state = RankState.STARTING
        r.last_heartbeat = 0.0
        r.phase, r.last_progress, r.last_begin, r.samples = "setup", 0.0, None, 0
        r.steps_ended, r.kill_reason, r.hung_since, r.final_step = False, None, 0.0, None
        path = self.log_dir / f"worker_{r.rank}.log"
        with open(path, "ab") as fh:
            header = (
                f"===== ftrun: rank {r.rank} incarnation {r.incarnation} attempt {self.attempt} "
                f"generation {self.generation} started {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
            )
            fh.write(header.encode())
            fh.flush()
            spare = self.take_spare(r, attempt_port, path) if use_spare else None
            r.proc = spare or procs.spawn(
                self.argv(), env=self.worker_env(r, attempt_port), stdout=fh.fileno(), stderr=subprocess.STDOUT
            )
        r.started_at = time.time()
        self.emit(
            EventKind.RANK_STARTED,
            f"rank {r.rank} started (pid {r.proc.pid}, incarnation {r.incarnation}{', in a warm spare' if spare else ''})",
            rank=r.rank,
            log=str(path),
            warm_spare=spare is not None,
        )

    # ----------------------------------------------------------------- warm spares
    def keep_spares(self) -> None:
        """Start warm spares once a rank has said hello through the worker library (only such jobs
        use ARF; the spare imports while the ranks set up), never while a recovery runs (it would
        compete with the recovery for the CPU)."""
        spec = self.spec
        self.spares = [p for p in self.spares if p.poll() is None]
        if (
            len(self.spares) >= spec.warm_spares
            or not spec.tft.arf
            or spec.no_python
            or spec.nnodes > 1
            or self.recovery is not None
            or not any(r.library for r in self.ranks.values())
        ):
            return
        model = next(iter(self.ranks.values()))
        with open(self.log_dir / "spares.log", "ab") as fh:
            spare = procs.spawn(
                [sys.executable, "-u", "-m", "ftrun.spare"],
                env=self.worker_env(model, self.attempt_port),
                stdout=fh.fileno(),
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
            )
        self.spares.append(spare)
        log.info("warm spare started (pid %d)", spare.pid)

    def take_spare(self, r: Rank, attempt_port: int, log_path: Path) -> subprocess.Popen | None:
        """Hand rank ``r``'s next incarnation to an idle warm spare; None if there is none."""
        while self.spares:
            spare = self.spares.pop(0)
            if spare.poll() is not None or spare.stdin is None:
                continue
            job = {
                "env": self.worker_env(r, attempt_port),
                "argv": [self.spec.script, *self.spec.script_args],
                "module": self.spec.module,
                "log": str(log_path),
                "cwd": os.getcwd(),
            }
            try:
                spare.stdin.write(json.dumps(job).encode())
                spare.stdin.close()
            except OSError:
                continue  # it died just now
            return spare
        return None

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
        self.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"ftrun-{os.getppid()}-{int(time.time())}"
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
        for name in spec.tft.not_implemented() if spec.tft_explicit else ():
            self.emit(EventKind.WARNING, f"TFT switch {name} is on but not implemented in this version of ftrun; it has no effect")
        self.start_attempt()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
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
                self.check_hangs()
                exit_code = self._pending_exit
            if exit_code is None and self.spec.warm_spares:
                self.keep_spares()
            self.publish_status()
        self.publish_status(force=True)
        procs.stop_all(self.spares, 0.0)
        self.close()
        return exit_code

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wakeup_w)

        def on_stop(signum: int, _frame: Any) -> None:
            self.stop_signal = signum

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        def on_child(_signum: int, _frame: Any) -> None:
            # The kernel sends SIGCHLD as a child dies: its arrival time dates the death, which is
            # what detection latency is measured from. The wakeup fd wakes the poll.
            if self._sigchld_at is None:
                self._sigchld_at = time.time()

        signal.signal(signal.SIGCHLD, on_child)

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self._wakeup_r, 4096):
                pass
        except BlockingIOError:
            pass

    # ----------------------------------------------------------------- process health
    def check_processes(self) -> int | None:
        """Reap exited ranks and act on failures. Returns the job's exit code once it ends."""
        now = time.time()
        died_at, self._sigchld_at = self._sigchld_at, None
        newly_failed: list[Rank] = []
        for r in self.ranks.values():
            if r.proc is None or r.exit_code is not None:
                continue
            rc = r.proc.poll()
            if rc is None:
                continue
            code, desc = procs.describe_exit(rc)
            if r.kill_reason is not None:
                desc = f"{r.kill_reason}; killed by ftrun"
            r.exit_code, r.exit_desc = code, desc
            procs.signal_group(r.proc, signal.SIGKILL)  # leave none of its children behind
            if code == 0:
                r.state = RankState.SUCCEEDED
                self.emit(EventKind.RANK_EXITED, f"rank {r.rank} finished ({desc})", rank=r.rank, exit_code=0)
                continue
            r.state = RankState.FAILED
            evidence_at = r.hung_since if r.kill_reason is not None else (died_at or now)
            failure = Failure(r.rank, r.pid, code, desc, now, detection_seconds=max(0.0, now - evidence_at))
            self.failures.append(failure)
            self.round_failures.append(failure)
            self.emit(
                EventKind.RANK_FAILED,
                f"rank {r.rank} failed: {desc} (pid {r.pid}, step {r.step})",
                rank=r.rank,
                exit_code=code,
                cause=desc,
                step=r.step,
                committed=r.committed,
                detected_at=now,
                detection_seconds=round(failure.detection_seconds, 4),
            )
            newly_failed.append(r)
        if newly_failed:
            result = self.on_failure([r.rank for r in newly_failed])
            if result is not None:
                return result
        if all(r.state == RankState.SUCCEEDED for r in self.ranks.values()):
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
        decision = decide_on_failure(
            failed,
            world_size=spec.worker_num,
            arf=spec.tft.arf,
            library_ranks=[r.rank for r in self.ranks.values() if r.library],
            restarts_used=self.restarts_used,
            max_restarts=spec.max_restarts,
            single_node=spec.nnodes == 1,
        )
        if decision.action == Action.FAIL_JOB:
            return self.finish_failed(decision.reason)
        if decision.action == Action.RESPAWN_RANKS:
            self.start_recovery(set(decision.ranks), decision.reason)
            return None
        return self.restart_job(decision.reason)

    def restart_job(self, reason: str) -> int | None:
        """Stop every rank and start them all again (torchrun semantics), from the newest checkpoint
        (a dying-gasp one if the live ranks could write it)."""
        if self.restarts_used + 1 > self.spec.max_restarts:
            return self.finish_failed(f"{reason}; restart budget exhausted (max_restarts={self.spec.max_restarts})")
        self.dying_gasp(reason)
        self.restarts_used += 1
        self.emit(
            EventKind.JOB_RESTARTING,
            f"restarting all ranks: {reason} (restart {self.restarts_used}/{self.spec.max_restarts})",
            reason=reason,
            restarts_used=self.restarts_used,
        )
        procs.stop_all([r.proc for r in self.ranks.values() if r.proc is not None], self.spec.grace_period)
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

    def finish_failed(self, reason: str) -> int:
        self.dying_gasp(reason)
        resume_hint = self.resume_hint()
        procs.stop_all([r.proc for r in self.ranks.values() if r.proc is not None], self.spec.grace_period)
        for r in self.ranks.values():
            if r.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.state = RankState.STOPPED
        root = (self.round_failures or self.failures)[0]
        tail = tail_lines(self.log_dir / f"worker_{root.rank}.log", 20)
        self.emit(
            EventKind.JOB_FINISHED,
            f"job failed: {reason}; root cause: rank {root.rank} ({root.description}){resume_hint}",
            rank=root.rank,
            pid=root.pid,
            exit_code=root.exit_code,
            reason=reason,
            root_cause={"rank": root.rank, "pid": root.pid, "exit_code": root.exit_code, "cause": root.description},
            log_tail=tail,
            restarts=self.restarts_used,
        )
        return root.exit_code

    def stop(self, code: int, reason: str) -> int:
        self.emit(EventKind.STOP_REQUESTED, f"{reason}: stopping all ranks (grace {self.spec.grace_period:g} s)")
        self.dying_gasp(reason)
        procs.stop_all([r.proc for r in self.ranks.values() if r.proc is not None], self.spec.grace_period)
        for r in self.ranks.values():
            if r.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.state = RankState.STOPPED
        self.emit(EventKind.JOB_FINISHED, f"job {reason}{self.resume_hint()}", exit_code=code, reason=reason)
        return code

    # ----------------------------------------------------------------- ARF recovery
    def start_recovery(self, failed: set[int], reason: str, kind: str = "death") -> None:
        """Begin (or restart) a recovery round: respawn ``failed`` and ask survivors to report.

        ``kind`` names the fault for the events: death, hang, comm_error (HCCE) or
        recoverable_error (UCE); the last two respawn nothing.
        """
        now = time.time()
        self.generation += 1
        for x in self.ranks.values():
            x.last_begin = None  # a step time measured across a recovery says nothing about steps
        if self.recovery is None:
            detection = max((f.detection_seconds for f in self.round_failures if f.rank in failed), default=0.0)
            self.recovery = Recovery(
                generation=self.generation, started_at=now - detection, failed=set(failed), detection_seconds=detection
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
            self.recovery.respawned_at[rank] = time.time()
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
        rec.planned_at = time.time()
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
        rec.recovered[r.rank] = dict(msg.fields, at=time.time())
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
            now = time.time()
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
        now = time.time()
        if self._unrepaired is not None and (self.recovery is not None or self.round_failures):
            self._unrepaired = None  # a death explains it; ARF or the restart policy handles that
        if self._unrepaired is not None and now - self._unrepaired[0] > UNREPAIRED_GRACE_S:
            reason, self._unrepaired = self._unrepaired[1], None
            self._pending_exit = self.restart_job(reason)
            return
        for r in self.ranks.values():
            if not r.alive() or r.kill_reason is not None:
                continue
            if r.identity is not None and now - r.last_heartbeat > spec.heartbeat_timeout:
                r.hung_since = r.last_heartbeat
                self.declare_hung(r, "no_heartbeat", f"no heartbeat for {now - r.last_heartbeat:.1f} s (--heartbeat_timeout {spec.heartbeat_timeout:g})")
                return
            if r.library and r.step is None and not r.steps_ended and now - r.started_at > spec.setup_timeout:
                r.hung_since = r.started_at
                self.declare_hung(r, "setup", f"no step begun {now - r.started_at:.0f} s after start (--setup_timeout {spec.setup_timeout:g})")
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
        culprits = [r for r in live if r.phase != "collective"]
        if culprits:
            for r in culprits:
                r.hung_since = last
                self.declare_hung(r, "no_progress", f"{stalled}; rank {r.rank} stuck at step {r.step} ({r.phase}) while its peers wait in the collective")
            return
        reason = f"{stalled}; every rank waits in the collective of step {max(r.step or 0 for r in live)}"
        self.emit(EventKind.WARNING, f"communication hang: {reason}", fault="comm_hang")
        if spec.tft.hcce and spec.tft.arf:
            self.start_recovery(set(), reason, kind="comm_error")
        else:
            self._pending_exit = self.restart_job(f"communication hang ({reason}) and HCCE is off")

    def declare_hung(self, r: Rank, kind: str, evidence: str) -> None:
        """Dump a hung rank's stacks into its log and an event, then SIGKILL it (recovered as a death)."""
        path = self.log_dir / f"worker_{r.rank}.log"
        stacks, note = self.dump_stacks(r, path)
        r.kill_reason = f"hung: {evidence}"
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"===== ftrun: rank {r.rank} (pid {r.pid}) hung: {evidence}; {note}; killing it =====\n")
        except OSError:
            pass
        self.emit(
            EventKind.RANK_HUNG,
            f"rank {r.rank} hung: {evidence}; {note}",
            rank=r.rank,
            fault=kind,
            evidence=evidence,
            step=r.step,
            phase=r.phase,
            heartbeat_age=round(time.time() - r.last_heartbeat, 3) if r.identity is not None else None,
            stack_dump=str(path) if stacks else None,
            stacks=stacks[-80:],
        )
        if r.proc is not None:
            procs.signal_group(r.proc, signal.SIGKILL)

    def dump_stacks(self, r: Rank, path: Path) -> tuple[list[str], str]:
        """Ask rank ``r`` for the Python stacks of all its threads (faulthandler, set up by the
        worker library on SIGUSR1) and return the lines it wrote to its log, and a note.

        A frozen (stopped) process cannot answer; it is not waited for.
        """
        import psutil

        if not r.library or r.pid is None:
            return [], "no stack dump (the rank does not use the worker library)"
        try:
            if psutil.Process(r.pid).status() == psutil.STATUS_STOPPED:
                return [], "no stack dump (the process is stopped)"
            start = path.stat().st_size
            os.kill(r.pid, signal.SIGUSR1)
        except (OSError, psutil.Error):
            return [], "no stack dump (the process is gone)"
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        size, changed = start, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                now_size = path.stat().st_size
            except OSError:
                break
            if now_size != size:
                size, changed = now_size, time.monotonic()
            elif size > start and time.monotonic() - changed >= 0.2:
                break  # written and quiet: the dump is complete
        if size <= start:
            return [], f"no stack dump within {STACK_DUMP_WAIT_S:g} s"
        with open(path, "rb") as fh:
            fh.seek(start)
            lines = fh.read(size - start).decode("utf-8", "replace").splitlines()
        return lines, f"stacks of all threads written to {path}"

    # ----------------------------------------------------------------- messages
    def send(self, r: Rank, msg_type: MsgType, **fields: Any) -> None:
        if r.identity is None:
            return  # not connected yet: it will get the current state when it says hello
        self.router.send_multipart([r.identity, encode(msg_type, self.auth, **fields)])

    def read_messages(self, budget: int = READ_BUDGET) -> None:
        """Handle up to ``budget`` frames waiting on the ROUTER.

        The budget bounds the time one call takes whatever arrives (a flood of forged frames), so
        the loop gets back to reaping deaths (SIGCHLD) and to the watchdog between batches.
        """
        for _ in range(budget):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            if identity in self._offenders:
                continue  # dropped unread: no MAC, no decode, no log
            if len(frames) != 2:
                self.reject(identity, "wrong number of frames")
                continue
            try:
                msg = decode(frames[1], self.auth)
            except ProtocolError as err:
                self.reject(identity, str(err))
                continue
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
        r = self.ranks.get(msg.get("rank")) if "rank" in msg.fields else None
        if r is None or msg.get("incarnation") != r.incarnation or not r.alive():
            self.reject(identity, f"{msg.type.value} for a rank/incarnation that is not live here")
            return
        if msg.type == MsgType.HELLO:
            if msg["pid"] != r.pid:
                self.reject(identity, f"hello for rank {r.rank} from pid {msg['pid']}, expected {r.pid}")
                return
            r.identity = identity
            r.library = bool(msg["library"])
            r.replica_group = tuple(int(x) for x in msg["replica_group"])
            r.last_heartbeat = time.time()
            r.state = RankState.HEALTHY if self.recovery is None else RankState.RECOVERING
            self.emit(EventKind.RANK_JOINED, f"rank {r.rank} connected (pid {r.pid})", rank=r.rank, library=r.library)
            if self.recovery is not None:
                self.recovery.joined_at.setdefault(r.rank, time.time())
                if msg["generation"] != self.recovery.generation:
                    self.send(r, MsgType.ABORT, generation=self.recovery.generation, reason="recovery in progress")
                else:
                    self.on_report(r, msg["generation"], NO_STATE)
            return
        if identity != r.identity:
            self.reject(identity, f"{msg.type.value} for rank {r.rank} from a connection that did not say hello")
            return
        now = time.time()
        r.last_heartbeat = now
        if msg.type == MsgType.HEARTBEAT:
            return
        if msg.type in (MsgType.STEP_BEGIN, MsgType.PROGRESS):
            r.step = msg["step"]
            r.last_progress = now
            if msg.type == MsgType.PROGRESS:
                r.metrics = {str(k): v for k, v in msg["metrics"].items() if isinstance(v, (int, float, str))}
            else:
                self.observe_step(r, msg["step"], now)
            self._status_dirty = True
        elif msg.type in (MsgType.COLLECTIVE, MsgType.UPDATE_BEGIN):
            r.phase, r.last_progress = ("collective" if msg.type == MsgType.COLLECTIVE else "update"), now
        elif msg.type == MsgType.UPDATE_END:
            r.committed = msg["step"]
            r.phase, r.last_progress = "compute", now
        elif msg.type == MsgType.STEPS_END:
            r.steps_ended, r.phase = True, "done"
        elif msg.type == MsgType.FAULT:
            r.committed = msg["committed"]
            r.phase = "recovering"
            if self._gasp is not None:
                if msg["generation"] == self._gasp["generation"]:
                    self._gasp["reports"][r.rank] = msg["committed"]
                return
            self.on_fault(r, msg)
        elif msg.type == MsgType.SAVED:
            if self._gasp is not None and msg["step"] == self._gasp.get("step"):
                self._gasp["saved"][msg["shard"]] = msg
            elif msg["reason"] == "periodic":
                self.on_periodic_save(msg)
        elif msg.type == MsgType.RECOVERED:
            self.on_recovered(r, msg)
        elif msg.type == MsgType.DONE:
            self.on_done(r, msg)
        elif msg.type == MsgType.ERROR:
            self.emit(EventKind.WARNING, f"rank {r.rank} reported: {msg['reason']}", rank=r.rank)
            if self._gasp is not None and r.rank in self._gasp.get("writers", {}).values():
                self._gasp["failed"] = f"rank {r.rank}: {msg['reason']}"

    def on_done(self, r: Rank, msg: Message) -> None:
        """A rank says it called ``ft.finish()``: a claim, never the job's end.

        The job ends when every rank's *process* has exited (code after ``finish()`` -- saving the
        model, writing metrics -- runs, as under torchrun). The claim is checked: ranks that
        finished at different committed steps are named in a warning (a diverged job).
        """
        r.steps_ended, r.phase = True, "done"
        committed = msg.get("committed")
        if isinstance(committed, int) and not isinstance(committed, bool):
            r.final_step = committed
            claims = {x.rank: x.final_step for x in self.ranks.values() if x.final_step is not None}
            if len(set(claims.values())) > 1:
                self.emit(EventKind.WARNING, f"ranks finished at different committed steps: {claims}", claims=claims)

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
        started = time.time()
        self.recovery = None
        self.generation += 1
        gasp: dict[str, Any] = {"generation": self.generation, "reports": {}, "saved": {}, "writers": {}}
        self._gasp = gasp
        try:
            for r in live:
                self.send(r, MsgType.ABORT, generation=self.generation, reason=f"saving a dying-gasp checkpoint: {reason}")
            self._pump(lambda: set(gasp["reports"]) >= {r.rank for r in live if r.alive()}, TTP_REPORT_WAIT_S)
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
            log.info("dying gasp took %.2f s", time.time() - started)
        finally:
            self._gasp = None

    def _pump(self, done: Any, timeout: float) -> None:
        """Handle control messages until ``done()`` or ``timeout`` seconds (a dying gasp)."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if self.router.poll(timeout=100):
                self.read_messages()

    def observe_step(self, r: Rank, step: int, now: float) -> None:
        """Record the time of the step before ``step`` (for the automatic step timeout)."""
        if r.last_begin is not None and r.last_begin[0] == step - 1:
            r.samples += 1
            if r.samples > self.spec.warmup_steps:
                self.max_step_time = max(self.max_step_time or 0.0, now - r.last_begin[1])
        r.last_begin = (step, now)
        r.phase = "compute"

    def on_fault(self, r: Rank, msg: Message) -> None:
        """A rank reports a failed collective, a recoverable error, or its answer to an abort."""
        rec = self.recovery
        kind = msg.get("kind", "comm")
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
                    self._unrepaired = (time.time(), f"{reason} and {switch} is off")
                return
            self.start_recovery(set(), reason, kind=event_kind)
            self.on_report(r, self.generation, msg["committed"])

    def close(self) -> None:
        self.router.close(0)
        if self.push is not None:
            self.push.close(2000)
        self.ctx.term()


def tail_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines a rank's current incarnation wrote to its log (empty if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = data.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("===== ftrun:")]
    return lines[(starts[-1] + 1) if starts else 0 :][-n:]


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def main() -> None:
    """Entry point of ``python -m ftrun.supervisor`` (started by the launcher, not by users)."""
    spec = JobSpec.from_json(json.loads(os.environ["FTRUN_SUPERVISOR_SPEC"]))
    log_dir = Path(spec.log_dir)
    logging.basicConfig(
        filename=log_dir / "supervisor.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sup = Supervisor(
        spec,
        token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
        events_addr=os.environ.get("FTRUN_EVENTS_ADDR"),
        store_port=int(os.environ["FTRUN_STORE_PORT"]),
    )
    try:
        code = sup.run()
    except BaseException:
        log.exception("supervisor crashed")
        raise
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()

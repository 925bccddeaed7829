"""The job coordinator: one per job, on node 0, where every job-wide decision is made.

It runs in node 0's supervisor process (``python -m ftrun.node.supervisor``, a child of the launcher),
beside node 0's agent (:class:`~ftrun.coordinator.agents.LocalAgent`); every other node's agent connects to it
over the authenticated control plane, and so does every rank of every node. :class:`Coordinator`
keeps the main loop, the job's phase and the restart policy's outcomes (respawn, restart, fail,
stop); its other roles are modules of this package, each used through public members:

- :mod:`.control`: the ROUTER socket, frame authentication, rejects, closed connections;
- :mod:`.membership`: node agents, node loss, fencing, replacements;
- :mod:`.environment`: the ranks' environment (torchrun's and msrun's contract), spawning, spares,
  each attempt's store;
- :mod:`.rounds`: ARF recovery rounds (respawn, plan, state transfer) and in-place repairs;
- :mod:`.watchdog`: hang verdicts from the rank table and a clock;
- :mod:`.ttp`: dying-gasp and periodic checkpoints, the checkpoint an attempt starts from;
- :mod:`.publish`: ``events.jsonl``, the console's events and ``status.json``;
- :mod:`.ranks` and :mod:`.phases`: the rank table and the job's phases.

Two clocks: ``clock`` (monotonic) for every deadline, ``wall`` (Unix time) for timestamps and for
the evidence times agents report (a death's ``SIGCHLD``), which are converted at the boundary.
Its exit code is the job's: 0, the root-cause rank's exit code (128+N for signal N), or 130/143
when stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from ftrun.common import procs
from ftrun.coordinator.agents import AgentHandle, RemoteAgent, SpareNote, Spawned, StandbyOffer, Stacks
from ftrun.common.clocks import RunningClock
from ftrun.config import JobSpec
from ftrun.common.events import Event, EventKind
from ftrun.coordinator.policy import Action, RankState, StartupFailures, decide_on_failure, restart_fits
from ftrun.common.protocol import Message, MsgType, Sender
from ftrun.node.spawner import ExitReport, StopReport
from ftrun.coordinator.control import ControlPlane
from ftrun.coordinator.environment import Spawning
from ftrun.coordinator.failover import Replication, restore
from ftrun.coordinator.messages import RankMessages
from ftrun.coordinator.elastic import Elastic, Shrink
from ftrun.coordinator.membership import Membership, NodeLoss, NoReplacement, QuorumLost
from ftrun.coordinator.phases import JobPhase, JobPhases
from ftrun.coordinator.publish import Publisher, status_header
from ftrun.coordinator.ranks import Failure, Rank, Recovery, first_failure_tail, teardown_crash
from ftrun.coordinator.rounds import RecoveryRounds
from ftrun.coordinator.ttp import Checkpoints
from ftrun.coordinator.watchdog import CommHang, Hung, Unrepaired, Watchdog, WatchdogBounds

log = logging.getLogger("ftrun.coordinator")

# A rank that ends with one of these after every other rank exited 0 crashed in its teardown (an
# abort or a segfault in a destructor): the job is not restarted for it (Coordinator.on_failure).
TEARDOWN_CRASH_CODES = frozenset({128 + signal.SIGABRT, 128 + signal.SIGSEGV})
STOP_REPORT_WAIT_S = 10.0  # past the grace period: how long stopped ranks' exits are waited for
ACTIVE = (JobPhase.RUNNING, JobPhase.RECOVERING)  # phases in which a failure is acted on


class Coordinator:
    """The job coordinator: every job-wide decision, for the ranks of every node.

    Args:
        spec: the job.
        token: the job secret (each node's agent gives it to its ranks; never sent).
        events_addr: the node-0 launcher's PULL endpoint for events and status, or None.
        store_port: the port of the launcher's store (attempt 0's ``MASTER_PORT``).
        local_agent: node 0's agent (in this process); other nodes' agents connect over the
            control plane and are added as :class:`~ftrun.coordinator.agents.RemoteAgent` when they say hello.
        clock: monotonic seconds for deadlines (injected by tests); by default a RunningClock
            (:mod:`ftrun.common.clocks`: this process's own stalls are no one's silence).
        wall: Unix time in seconds, for timestamps.

    ``run()`` returns the job's exit code.
    """

    def __init__(self, spec: JobSpec, token: str, events_addr: str | None, store_port: int,
                 local_agent: AgentHandle | None = None, clock: Callable[[], float] | None = None,
                 wall: Callable[[], float] = time.time, control: ControlPlane | None = None,
                 audience: int = 0) -> None:
        from ftrun.common.stores import bind_host

        self.spec, self.token, self.wall = spec, token, wall
        self.clock = clock if clock is not None else RunningClock.for_loop(spec.monitor_interval)
        self.log_dir = Path(spec.log_dir)
        self.ctx = zmq.Context()
        if control is None:
            bind = bind_host(spec.master_addr, spec.nnodes)
            control = ControlPlane(self.ctx, token, bind, "127.0.0.1" if bind == "127.0.0.1" else spec.master_addr)
        self.control = control  # a standby's was bound before the takeover (ftrun.coordinator.failover)
        control.serve(on_agent=self.on_agent_message, on_rank=self.handle, on_reject=self._on_reject,
                      protected=lambda: {r.proc.identity for r in self.ranks.values() if r.proc.identity})
        push = None
        if events_addr:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.setsockopt(zmq.SNDHWM, 100_000)
            push.connect(events_addr)
        self.publisher = Publisher(self.log_dir, spec.node_rank, Sender(self.control.sender.auth), push, self.clock, audience)
        local = spec.local_worker_num
        self.ranks = {rank: Rank(rank=rank, local_rank=rank % local, node=rank // local) for rank in range(spec.worker_num)}
        self.phase = JobPhases(on_change=lambda old, new: log.info("job phase %s -> %s", old.value, new.value))
        self.epoch = 0  # the coordinator epoch: moved on by every takeover (ftrun.coordinator.failover)
        self.takeover_at = 0.0  # when this coordinator took the job over (its clock), if it did
        self.attempt = 0
        self.generation = 0
        self.restarts_used = 0
        self.failures: list[Failure] = []
        self.round_failures: list[Failure] = []
        self.elastic = Elastic(self)  # --nnodes MIN:MAX: where an absent node's ranks run
        self.members = Membership(self, local_agent)
        self.spawning = Spawning(self, store_port)
        self.rounds = RecoveryRounds(self)
        self.messages = RankMessages(self)
        self.ttp = Checkpoints(self)
        self.failover = Replication(self)
        self.watchdog = Watchdog(WatchdogBounds(spec.heartbeat_timeout, spec.heartbeat_interval, spec.setup_timeout,
                                                spec.step_timeout, spec.step_timeout_min, spec.step_timeout_factor,
                                                spec.warmup_steps))
        self.startup = StartupFailures(spec.worker_num)  # failures before ftrun.init, held to see if all fail alike
        self.stop_signal: int | None = None
        self.exit_code: int | None = None  # set once the job's end is decided
        self._final_message: str | None = None
        self._hung: dict[tuple[int, int], tuple[Any, ...]] = {}  # (rank, incarnation) -> what the watchdog saw
        self._wakeup = procs.WakeupPipe()

    # ----------------------------------------------------------------- the roles' public faces
    @property
    def control_addr(self) -> str:
        return self.control.address

    @property
    def recovery(self) -> Recovery | None:
        """The recovery in progress, or None."""
        return self.rounds.current

    @property
    def agents(self) -> dict[int, AgentHandle]:
        return self.members.agents

    @property
    def lost_nodes(self) -> dict[int, str]:
        return self.members.lost_nodes

    @property
    def rejected(self) -> int:
        return self.control.rejected

    @property
    def observers(self) -> list[Callable[[Event], None]]:
        return self.publisher.observers

    def spawn(self, r: Rank, use_spare: bool = False) -> None:
        self.spawning.spawn(r, use_spare)

    def start_attempt(self) -> None:
        self.spawning.start_attempt()

    def step_timeout(self) -> float:
        return self.watchdog.step_timeout()

    def send(self, r: Rank, msg_type: MsgType, **fields: Any) -> None:
        """Send a message to a rank's process (dropped if it has not said hello: it gets the
        current state then)."""
        if r.proc.identity is not None:
            self.control.send(r.proc.identity, msg_type, fields)

    def read_messages(self, agents_only: bool = False) -> None:
        self.control.read(agents_only=agents_only, stop=lambda: self.exit_code is not None)

    def finish_with(self, code: int | None) -> None:
        """Record the job's exit code, once decided (``None``: not decided)."""
        if code is not None and self.exit_code is None:
            self.exit_code = code

    # ----------------------------------------------------------------- events and status
    def emit(self, kind: EventKind, message: str, rank: int | None = None, **detail: Any) -> Event:
        """Record an event in events.jsonl and push it to the launcher."""
        r = self.ranks.get(rank) if rank is not None else None
        return self.publisher.emit(kind, message, r, self.generation, self.attempt, rank=rank, **detail)

    def _on_reject(self, why: str, total: int) -> None:
        self.emit(EventKind.MESSAGE_REJECTED, f"rejected a control message: {why}", reason=why, total=total)

    def status_snapshot(self) -> dict[str, Any]:
        """The job as ``ftrun status`` shows it: its phase, counters and every rank's row."""
        now = self.clock()
        return {
            "ranks": [r.status(now) for r in self.ranks.values()],
            "attempt": self.attempt,
            "generation": self.generation,
            "phase": self.phase.current.value,
            "restarts_used": self.restarts_used,
            "max_restarts": self.spec.max_restarts,
            "recovering": self.rounds.current is not None,
            "world_size": self.spec.worker_num,
            "nnodes": self.spec.nnodes,
            "lost_nodes": {str(k): v for k, v in self.members.lost_nodes.items()},
            "standby_nodes": self.members.standby_node_rows(),
            "standby_coordinators": [seat.node for seat in self.failover.seats],  # in line, first first
            "coordinator_node": self.spec.node_rank, "coordinator_epoch": self.epoch,
            **self.ttp.status(), **self.elastic.status(), **status_header(),
        }

    def publish_status(self, force: bool = False, final: dict[str, Any] | None = None) -> None:
        self.publisher.status(self.status_snapshot, force=force, final=final)

    # ----------------------------------------------------------------- main loop
    def run(self, takeover: dict[str, Any] | None = None, lost: list[int] | tuple[int, ...] = (0,),
            cause: str = "") -> int:
        """Run the job to its end and return the exit code. With ``takeover`` (the hard state a
        standby was sent, :func:`ftrun.coordinator.failover.hard_state`), go on with a job whose
        coordinator died or was cut off on the first node of ``lost`` (the others: standby
        coordinators that died before this one could take over; ``cause``, in words), instead of
        starting one."""
        self._install_signals()
        spec = self.spec
        if takeover is None:
            self.spawning.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"ftrun-{os.getppid()}-{int(self.wall())}"
            self.emit(EventKind.JOB_STARTED,
                      f"job started: {spec.worker_num} rank(s), {spec.local_worker_num} on node {spec.node_rank}, "
                      f"max_restarts={spec.max_restarts}, TFT={spec.tft}",
                      script=spec.script, args=list(spec.script_args), control=self.control_addr)
            for warning in spec.warnings:
                self.emit(EventKind.WARNING, warning)
            for name in spec.tft.not_implemented() if spec.tft_explicit else ():
                self.emit(EventKind.WARNING, f"TFT switch {name} is on but not implemented in this version of ftrun; it has no effect")
            note = self.agents[0].start_note() if 0 in self.agents else None
            if note:
                self.emit(EventKind.WARNING, note)
            self.spawning.publish_control_addr()
            self.start_attempt()
        else:
            self.take_over(takeover, lost, cause)
        poller = zmq.Poller()
        poller.register(self.control.router, zmq.POLLIN)
        poller.register(self.control.disconnects, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while self.exit_code is None:
            poller.poll(timeout=int(spec.monitor_interval * 1000))
            self._wakeup.drain()
            if self.stop_signal is not None:
                self.finish_with(self.stop(128 + self.stop_signal, f"stopped by {signal.Signals(self.stop_signal).name}"))
                break
            self.finish_with(self.check_processes())
            if self.exit_code is None:
                self.read_messages()
            if self.exit_code is None:
                self.finish_with(self.check_agents())
            if self.exit_code is None:
                self.check_hangs()
            if self.exit_code is None:
                self.spawning.keep_spares()
            if self.exit_code is None:
                self.failover.replicate(self.clock())
            self.publish_status()
        code = self.exit_code
        assert code is not None
        self.publish_status(final={"exit_code": code, "message": self._final_message or ""})
        message = self._final_message or f"job finished with exit code {code}"
        for agent in [*self.agents.values(), *self.members.standby_nodes.values()]:
            agent.shutdown(code, message)
        self.close()
        return code

    def _install_signals(self) -> None:
        self._wakeup.install()

        def on_stop(signum: int, _frame: Any) -> None:
            self.stop_signal = signum

        def on_child(_signum: int, _frame: Any) -> None:
            # The kernel sends SIGCHLD as a child dies: its arrival time dates the death, which is
            # what detection latency is measured from. The wakeup fd wakes the poll.
            for agent in self.agents.values():
                agent.note_child_signal(self.wall())

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGCHLD, on_child)

    def pump(self, done: Callable[[], bool], timeout: float) -> None:
        """Handle control messages until ``done()`` or ``timeout`` seconds (a dying gasp); deaths
        meanwhile are recorded, not recovered."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            if self.control.router.poll(timeout=100):
                self.read_messages()
            self.failover.beat_ranks(self.clock())  # the ranks' beats (silence would send them to the standby)
            for r in self.collect_reports():
                log.info("rank %d died during the dying gasp", r.rank)

    # ----------------------------------------------------------------- nodes
    def check_agents(self) -> int | None:
        """Beat to the other nodes' agents and act on a lost node (:meth:`Membership.check`).
        Returns the job's exit code once it ends."""
        found = self.members.check(self.control.closed_agent_connections(), self.clock())
        if isinstance(found, Shrink):  # an elastic job's absent node: its ranks run on the others
            return self.elastic.shrink(found)
        return (self.finish_failed(found.reason) if isinstance(found, NoReplacement) else self.step_down(found)
                if isinstance(found, QuorumLost) else self.node_lost(found) if isinstance(found, NodeLoss) else None)

    def node_lost(self, loss: NodeLoss) -> int | None:
        """A node is gone with its ranks (pod-level rescheduling, MindCluster's term).

        Its agent's connection is fenced, its ranks are recorded as failed, and the failure goes
        through the same policy as a rank's death. With ARF on, the survivors are aborted to a safe
        point and the node's ranks are respawned as soon as a replacement launcher with that
        node's index joins (from any host, within ``--node_wait_timeout``), then recover from
        replicas on the surviving nodes; a whole-job restart likewise waits for the node. Without
        ARF, or past the budget, the job fails after a dying-gasp checkpoint. While the job is
        already restarting or ending, the loss is only recorded. Returns the exit code once the
        job ends.
        """
        node, reason = loss.node, loss.reason
        self.members.lose(node, reason)
        now, wall = self.clock(), self.wall()
        lost = [r for r in self.ranks.values() if r.node == node and r.proc.state != RankState.SUCCEEDED]
        for r in lost:
            r.proc.running = False
            r.proc.exit_code, r.proc.exit_desc, r.proc.state = 1, reason, RankState.FAILED
            self._record_failure(Failure(r.rank, r.proc.pid, 1, reason, wall, detection_seconds=loss.evidence_age))
        if self.phase.current not in ACTIVE:
            return None
        waits = loss.replaceable and self.spec.tft.arf and bool(lost) and not self.spec.join
        self.emit(EventKind.NODE_LOST, reason + ("; a standby node takes it" if waits and self.members.standby_nodes else
                                                 f"; waiting up to {self.spec.node_wait_timeout:g} s for a replacement "
                                                 f"launcher with --node_rank {node}" if waits else ""),
                  node_lost=node, ranks=[r.rank for r in lost], waiting=waits, cause=loss.cause,
                  detection_seconds=round(loss.evidence_age, 4))
        if not waits:
            return self.finish_failed(reason)
        self.members.await_replacement(node, reason, now)
        return self.on_failure([r.rank for r in lost], kind="node_loss")

    def take_over(self, state: dict[str, Any], lost: list[int] | tuple[int, ...], cause: str = "") -> None:
        """Go on with the job after its coordinator died or was cut off on the first node of
        ``lost``, and the standby coordinators before this one on the others died (this is a
        standby's process; ``cause``: how it was found, in words): its hard state restored with
        the epoch moved on, the store and endpoint published, then each node of ``lost`` handled
        as any lost node (its ranks recovered from replicas once a launcher takes its index)."""
        restore(self, state)
        self.spawning.attempt_port = self.spawning.store_port
        cause = cause or "its connection to this standby closed (its processes or its host died)"
        lost = list(dict.fromkeys(lost)) or [0]
        self.emit(EventKind.COORDINATOR_TAKEOVER,
                  f"node {self.spec.node_rank} took over as the job coordinator (epoch {self.epoch}): node {lost[0]}'s "
                  f"coordinator is gone" + (f", and the standby coordinator(s) on node(s) {lost[1:]}" if lost[1:] else "")
                  + f": {cause}",
                  node=self.spec.node_rank, lost=lost[0], lost_standbys=lost[1:], epoch=self.epoch,
                  control=self.control_addr, store=f"{self.spec.master_addr}:{self.spawning.store_port}", cause=cause)
        self.spawning.publish_control_addr()
        for node in lost:
            if self.exit_code is None and node not in self.members.lost_nodes:
                what = "with the job coordinator" if node == lost[0] else "with a standby job coordinator"
                self.finish_with(self.node_lost(NodeLoss(node, f"node {node} lost {what}: {cause}", "coordinator_lost")))

    def step_down(self, lost: QuorumLost) -> int:
        """This coordinator lost its quorum (:meth:`Membership.quorum`): stop this side of the
        job without a dying gasp (the standby may go on with it: a checkpoint written here would
        race the job's), and end with exit code 1. Agents and ranks that moved to the standby
        never come back here: their old connections are closed, and the new coordinator's epoch
        is higher."""
        reason = f"node {self.spec.node_rank} stepped down as the job coordinator (epoch {self.epoch}): {lost.reason}"
        self.emit(EventKind.COORDINATOR_STEPPED_DOWN, reason, node=self.spec.node_rank, epoch=self.epoch)
        self.phase.move(JobPhase.STOPPING)
        for node, agent in list(self.agents.items()):
            if isinstance(agent, RemoteAgent):  # out of reach: those ranks are the other side's now
                del self.agents[node]
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.proc.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.proc.state = RankState.STOPPED
        self.phase.move(JobPhase.FINISHED)
        self._final_message = f"{reason}; this node's ranks were stopped and it leaves the job"
        self.emit(EventKind.JOB_FINISHED, self._final_message, exit_code=1, reason=lost.reason, fenced=True)
        return 1

    def on_agent_message(self, identity: bytes, msg: Message, fd: int | None = None) -> None:
        """An agent's message (:meth:`Membership.on_agent_message`); a replacement's hello while
        the old agent is silent first makes the old one's node lost."""
        loss = self.members.on_agent_message(identity, msg, fd)
        if loss is not None:
            self.finish_with(self.node_lost(loss))
            if self.exit_code is None:
                self.members.on_agent_message(identity, msg, fd)  # now awaited: accepted

    # ----------------------------------------------------------------- process health
    def _record_failure(self, failure: Failure) -> None:
        self.failures.append(failure)
        self.round_failures.append(failure)

    def collect_reports(self, stopping: bool = False) -> list[Rank]:
        """Take every agent's reports (spawned, exited, stopped, stacks) and apply them; return the
        ranks that failed (exited non-zero) in them. With ``stopping`` (every rank is being
        stopped), or from a node that is leaving the job, an exit is recorded, not a failure."""
        newly_failed: list[Rank] = []
        for agent in list(self.agents.values()):
            for report in agent.take_reports():
                if isinstance(report, SpareNote):
                    self.emit(EventKind.WARNING, f"node {agent.node}: {report.message}", fault="hot_spare_contract")
                    continue
                if isinstance(report, StandbyOffer):
                    self.failover.on_standby(agent.node, report.control, report.store)
                    continue
                r = self.ranks.get(report.rank)
                if r is None or report.incarnation != r.incarnation:
                    continue  # an older process of the rank: nothing to act on
                if isinstance(report, Spawned):
                    self.spawning.on_spawned(r, report.pid, report.spare)
                elif isinstance(report, Stacks):
                    self.on_stacks(r, report)
                elif isinstance(report, StopReport) and r.alive() and r.proc.kill_reason is None and not stopping:
                    # Frozen by a signal: its parent saw it at once; no need to wait for the heartbeats.
                    try:
                        name = signal.Signals(report.signal).name
                    except ValueError:
                        name = f"signal {report.signal}"
                    self.declare_hung(r, Hung(r.rank, "stopped", f"stopped by {name} (seen by its parent at once)",
                                              self.clock() - max(0.0, self.wall() - report.at)))
                elif isinstance(report, ExitReport) and r.alive() and (stopping or agent.leaving):
                    r.proc.running = False  # a stop, or its node is leaving the job (a node loss, handled as one)
                    r.proc.exit_code, r.proc.exit_desc = procs.describe_exit(report.returncode)
                elif isinstance(report, ExitReport) and r.alive() and self.on_exit(r, report):
                    newly_failed.append(r)
        return newly_failed

    def on_exit(self, r: Rank, report: ExitReport) -> bool:
        """Record a rank's exit; True when it failed."""
        p = r.proc
        p.running = False
        if p.pid is None:
            p.pid = report.pid
        code, desc = procs.describe_exit(report.returncode)
        if p.kill_reason is not None:
            desc = f"{p.kill_reason}; killed by ftrun"
        elif report.error:
            desc = f"{desc}: {report.error}"  # the exception torchrun's @record wrote
        p.exit_code, p.exit_desc = code, desc
        if code == 0:
            p.state = RankState.SUCCEEDED
            self.emit(EventKind.RANK_EXITED, f"rank {r.rank} finished ({desc})", rank=r.rank, exit_code=0)
            return False
        p.state = RankState.FAILED
        wall = self.wall()
        # detection: from the evidence (the SIGCHLD's arrival, or the hang's start) to now
        detection = self.clock() - p.hung_since if p.kill_reason is not None else wall - report.at
        failure = Failure(r.rank, p.pid, code, desc, wall, detection_seconds=max(0.0, detection), log_tail=tuple(report.log_tail))
        self._record_failure(failure)
        self.emit(EventKind.RANK_FAILED,
                  f"rank {r.rank} failed: {desc} (pid {p.pid}, step {p.step}{f', node {r.node}' if self.spec.nnodes > 1 else ''})",
                  rank=r.rank, exit_code=code, cause=desc, step=p.step, committed=p.committed, node=r.node, detected_at=wall,
                  detection_seconds=round(failure.detection_seconds, 4),
                  **({"log_tail": list(report.log_tail)} if report.log_tail else {}))
        return True

    def check_processes(self) -> int | None:
        """Apply the agents' reports and act on failures. Returns the job's exit code once it ends."""
        newly_failed = self.collect_reports()
        result = (self.on_failure([r.rank for r in newly_failed]) if newly_failed
                  else self.settle_startup() if self.startup.held else None)
        if result is not None:
            return result
        self.release_finish_barrier()  # a rank may have exited 0 without ft.finish(), or a recovery ended
        if all(r.proc.state == RankState.SUCCEEDED for r in self.ranks.values()):
            self._final_message = "job succeeded"
            self.phase.move(JobPhase.FINISHED)
            self.emit(EventKind.JOB_FINISHED, "job succeeded", exit_code=0, restarts=self.restarts_used)
            return 0
        if self.spec.join and any(r.proc.state == RankState.FAILED for r in self.ranks.values()):
            if all(not r.alive() for r in self.ranks.values()):
                return self.finish_failed("a rank failed and --join let the others finish")
        return None

    # ----------------------------------------------------------------- the policy's outcomes
    def on_failure(self, failed: list[int], kind: str = "death") -> int | None:
        """Ranks failed (``kind``: death, or node_loss): respawn them (ARF), restart the job, or fail
        it (:func:`ftrun.coordinator.policy.decide_on_failure`). While the job is already restarting or ending,
        the failure is only recorded. Failures before ``ftrun.init`` may be held a few seconds
        (:class:`ftrun.coordinator.policy.StartupFailures`: does every rank fail alike?)."""
        if self.spec.join or self.phase.current not in ACTIVE:
            return None
        if self.elastic.home(failed):  # stopped to move back to their node, which joined: no restart spent
            return self.rounds.start(set(failed), f"rank(s) {sorted(failed)} move back to their node", kind="grow")
        if self.ttp.unusable() is not None:
            return self.restart_job(f"rank(s) {sorted(failed)} failed")
        now = self.clock()
        early = {f: self.ranks[f].proc.exit_code or 0 for f in failed if not self.ranks[f].started_up(now)}
        if early or self.startup.held:
            hello = len(early) < len(failed) or any(r.started_up(now) for r in self.ranks.values() if r.rank not in early)
            held = self.startup.hold(early, now, hello)
            return None if held is None else self.decide(sorted({*failed, *held}), kind)
        return self.decide(failed, kind)

    def settle_startup(self) -> int | None:
        """Decide on failures before ``ftrun.init`` once held long enough (:meth:`on_failure`)."""
        found = self.startup.settle(now := self.clock(), any(r.started_up(now) for r in self.ranks.values() if r.rank not in self.startup.exits),
                                    sum(r.alive() for r in self.ranks.values()))
        if found is None or self.phase.current not in ACTIVE:
            return None
        return self.finish_failed(found[1]) if found[1] else self.decide(found[0], "death")

    def decide(self, failed: list[int], kind: str) -> int | None:
        """Apply the policy to ranks that failed (:meth:`on_failure`)."""
        spec = self.spec
        others = [r for r in self.ranks.values() if r.rank not in failed]
        if others and all(r.proc.state == RankState.SUCCEEDED for r in others) and all(
                (not self.ranks[f].library or self.ranks[f].proc.finished)
                and self.ranks[f].proc.exit_code in TEARDOWN_CRASH_CODES for f in failed):
            return self.finish_failed(teardown_crash(failed, self.ranks[failed[0]].proc.exit_desc))
        decision = decide_on_failure(failed, world_size=spec.worker_num, arf=spec.tft.arf,
                                     library_ranks=[r.rank for r in self.ranks.values() if r.library],
                                     restarts_used=self.restarts_used, max_restarts=spec.max_restarts,
                                     one_event=kind == "node_loss")
        if decision.action == Action.FAIL_JOB:
            return self.finish_failed(decision.reason)
        if decision.action == Action.RESPAWN_RANKS:
            self.rounds.start(set(decision.ranks), decision.reason, kind=kind)
            return None
        return self.restart_job(decision.reason)

    def restart_job(self, reason: str) -> int | None:
        """Stop every rank and start them all again (torchrun semantics), from the newest checkpoint
        (a dying-gasp one if the live ranks could write it)."""
        if self.phase.current not in ACTIVE:
            return None
        unusable = self.ttp.unusable()
        if unusable is not None:
            # The attempt's checkpoint does not load (its ranks marked it): not the job's fault, so
            # no restart is counted; the next attempt skips it for the next older one.
            assert self.ttp.resume_from is not None
            reason = f"{reason}; checkpoint {self.ttp.resume_from.directory} is unusable: {unusable[0]} {unusable[1]}"
        elif not restart_fits(self.restarts_used, 1, self.spec.max_restarts):
            return self.finish_failed(f"{reason}; restart budget exhausted (max_restarts={self.spec.max_restarts})")
        else:
            self.ttp.dying_gasp(reason)
            self.restarts_used += 1
        self.phase.move(JobPhase.RESTARTING)
        self.emit(EventKind.JOB_RESTARTING, f"restarting all ranks: {reason} (restart {self.restarts_used}/{self.spec.max_restarts})",
                  reason=reason, restarts_used=self.restarts_used)
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.proc.exit_code is None:
                r.proc.state = RankState.STOPPED
            r.restarts += 1
            r.library = False
        self.rounds.current = None
        self.round_failures = []
        self.startup.new_attempt()
        self.attempt += 1
        self.generation = 0
        self.start_attempt()
        self.phase.move(JobPhase.RUNNING)
        return None

    def stop_all_ranks(self) -> None:
        """Stop every rank on every node (SIGTERM, SIGKILL after ``--grace_period``) and wait until
        each exit is reported, at most :data:`STOP_REPORT_WAIT_S` seconds past the grace period
        (a rank whose node is lost is taken as stopped). Exits seen here are stops, not failures."""
        self.members.pending_spawns.clear()
        for agent in self.agents.values():
            agent.stop_ranks(self.spec.grace_period)
        deadline = time.monotonic() + self.spec.grace_period + STOP_REPORT_WAIT_S
        while True:
            self.collect_reports(stopping=True)
            for r in self.ranks.values():
                agent = self.agents.get(r.node)
                if r.alive() and (agent is None or not agent.connected()):
                    r.proc.running = False  # nobody left to stop it or to tell
            if not any(r.alive() for r in self.ranks.values()) or time.monotonic() > deadline:
                return
            if self.control.router.poll(timeout=50):
                self.read_messages(agents_only=True)

    def _end(self, reason: str) -> str:
        """The common end of a failed or stopped job: a dying gasp, every rank stopped; returns the
        resume hint for the final message."""
        self.ttp.dying_gasp(reason)
        self.phase.move(JobPhase.STOPPING)
        hint = self.ttp.resume_hint()
        self.stop_all_ranks()
        for r in self.ranks.values():
            if r.proc.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.proc.state = RankState.STOPPED
        self.phase.move(JobPhase.FINISHED)
        return hint

    def finish_failed(self, reason: str) -> int:
        """End the job as failed; the exit code is the root cause's (the first failure of the last round)."""
        hint = self._end(reason)
        root = (self.round_failures or self.failures)[0]
        tail, same = first_failure_tail(self.failures, root.rank, self.log_dir)
        self._final_message = f"job failed: {reason}; root cause: rank {root.rank} ({root.description}){same}{hint}"
        self.emit(EventKind.JOB_FINISHED, self._final_message, rank=root.rank, pid=root.pid, exit_code=root.exit_code,
                  reason=reason, root_cause={"rank": root.rank, "pid": root.pid, "exit_code": root.exit_code,
                                             "cause": root.description},
                  log_tail=tail, restarts=self.restarts_used)
        return root.exit_code

    def stop(self, code: int, reason: str) -> int:
        """Stop the job (a signal, a divergence under ``--on_divergence fail``) with exit code ``code``."""
        self.emit(EventKind.STOP_REQUESTED, f"{reason}: stopping all ranks (grace {self.spec.grace_period:g} s)")
        self._final_message = f"job {reason}{self._end(reason)}"
        self.emit(EventKind.JOB_FINISHED, self._final_message, exit_code=code, reason=reason)
        return code

    # ----------------------------------------------------------------- watchdog
    def check_hangs(self) -> None:
        """Act on what the watchdog finds (:meth:`Watchdog.inspect`)."""
        spec = self.spec
        found = self.watchdog.inspect(self.ranks.values(), self.rounds.current, bool(self.round_failures),
                                      set(self.agents), self.clock(), self.members.quiet_nodes(self.clock()))
        if isinstance(found, Unrepaired):
            self.finish_with(self.restart_job(found.reason))
        elif isinstance(found, CommHang):
            self.emit(EventKind.WARNING, f"communication hang: {found.reason}", fault="comm_hang")
            if spec.tft.hcce and spec.tft.arf:
                self.rounds.start(set(), found.reason, kind="comm_error")
            else:
                self.finish_with(self.restart_job(f"communication hang ({found.reason}) and HCCE is off"))
        elif found:
            for hung in found:
                self.declare_hung(self.ranks[hung.rank], hung)

    def declare_hung(self, r: Rank, hung: Hung) -> None:
        """Have the rank's agent dump its stacks into its log and SIGKILL it (then it is recovered
        as a death); the ``rank_hung`` event follows, with the stacks, when the agent reports."""
        p = r.proc
        p.kill_reason, p.hung_since = f"hung: {hung.evidence}", hung.since
        self._hung[(r.rank, r.incarnation)] = (hung.kind, hung.evidence, p.step, p.phase.value,
                                               round(self.clock() - p.last_heartbeat, 3) if p.identity is not None else None)
        agent = self.agents.get(r.node)
        if agent is not None:
            # Only the worker library installs the SIGUSR1 stack dump; SIGUSR1 would kill any other script.
            agent.kill_hung(r.rank, r.incarnation,
                            f"===== ftrun: rank {r.rank} (pid {p.pid}) hung: {hung.evidence}; {{note}}; killing it =====",
                            dump=r.library)

    def on_stacks(self, r: Rank, report: Stacks) -> None:
        kind, evidence, step, phase, heartbeat_age = self._hung.pop(
            (r.rank, report.incarnation), ("unknown", "", r.proc.step, r.proc.phase.value, None))
        where = self.log_dir / f"worker_{r.rank}.log"
        self.emit(EventKind.RANK_HUNG, f"rank {r.rank} hung: {evidence}; {report.note}", rank=r.rank, fault=kind,
                  evidence=evidence, step=step, phase=phase, heartbeat_age=heartbeat_age,
                  stack_dump=(str(where) + (f" on node {r.node}" if r.node else "")) if report.lines else None,
                  stacks=report.lines[-80:])

    # ----------------------------------------------------------------- ranks' messages
    def handle(self, identity: bytes, msg: Message) -> None:
        """A rank's authenticated message (:meth:`RankMessages.handle`)."""
        self.messages.handle(identity, msg)

    def release_finish_barrier(self) -> None:
        self.messages.release_finish_barrier()

    def close(self) -> None:
        self.control.close()
        self.publisher.close()
        self.ctx.term()

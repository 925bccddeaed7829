"""The job coordinator: one per job, on node 0, where every job-wide decision is made.

It runs in node 0's supervisor process (``python -m ftrun.node.supervisor``, a child of the launcher),
beside node 0's agent (:class:`~ftrun.coordinator.agents.LocalAgent`); every other node's agent connects to it
over the authenticated control plane, and so does every rank of every node. :class:`Coordinator`
wires the roles, keeps the main loop, the job's phase and its hard state (:class:`~.state.JobState`),
and reads the nodes' health; its other roles are modules of this package, each used through public
members:

- :mod:`.failures`: a rank's failure, from the evidence (agents' reports, hangs, a lost node) to
  the policy's decision (:mod:`ftrun.coordinator.policy`) carried out;
- :mod:`.ending`: whole-job restarts, the job's failure, a stop, stepping down; the exit code;
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
from ftrun.common.clocks import RunningClock
from ftrun.common.events import Event, EventKind
from ftrun.common.protocol import Message, MsgType, Sender
from ftrun.config import JobSpec
from ftrun.coordinator.agents import AgentHandle
from ftrun.coordinator.collector import Collector
from ftrun.coordinator.control import ControlPlane
from ftrun.coordinator.elastic import Elastic, Shrink
from ftrun.coordinator.ending import JobEnd
from ftrun.coordinator.environment import Spawning
from ftrun.coordinator.failover import Replication, restore
from ftrun.coordinator.failures import Failures
from ftrun.coordinator.membership import Membership, NodeLoss, NoReplacement, QuorumLost
from ftrun.coordinator.messages import RankMessages
from ftrun.coordinator.phases import JobPhases
from ftrun.coordinator.policy import TEARDOWN_CRASH_CODES, RankState  # noqa: F401 (TEARDOWN_CRASH_CODES: exported by the package)
from ftrun.coordinator.publish import STATUS_PERIOD_S, Publisher, status_gap, status_header
from ftrun.coordinator.ranks import Rank, RecoveryRound
from ftrun.coordinator.rounds import RecoveryRounds
from ftrun.coordinator.state import JobState, JobStateField
from ftrun.coordinator.ttp import Checkpoints
from ftrun.coordinator.watchdog import Hung, Watchdog, WatchdogBounds

log = logging.getLogger("ftrun.coordinator")

#: The passes over every rank (the watchdog, the spares, the standbys' replica) run at most every
#: ``ranks / SCAN_RANKS_PER_S`` seconds, and at most every ``--monitor_interval`` (Coordinator._scan_due).
SCAN_RANKS_PER_S = 20_000

#: In a job whose status snapshots are spaced by their cost (``status_gap`` above STATUS_PERIOD_S:
#: more than 512 ranks), none is made in a recovery round's first seconds: at 16,384 ranks one
#: takes a tenth of a second or more, which every rank of the round would wait for. Events go on.
ROUND_STATUS_HOLD_S = 2.0


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
        self.state = JobState()  # epoch, attempt, generation, restarts spent, failures
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
        self.failures = Failures(self)
        self.end = JobEnd(self)
        self.stop_signal: int | None = None
        self._wakeup = procs.WakeupPipe()
        self._scanned_at = float("-inf")  # the last passes over every rank (_scan_due)
        self._scans = 0  # passes due or put off so far (scanned)
        self.collector = Collector(self)  # gc.freeze, and the collector held in a round's first seconds
        self.behind_since: float | None = None  # since when frames have waited unread (heard_until)

    # ----------------------------------------------------------------- the roles' public faces
    epoch = JobStateField()  # the coordinator epoch: moved on by every takeover (ftrun.coordinator.failover)
    takeover_at = JobStateField()  # when this coordinator took the job over (its clock), if it did
    attempt = JobStateField()
    generation = JobStateField()
    restarts_used = JobStateField()

    @property
    def exit_code(self) -> int | None:
        """The job's exit code, once its end is decided."""
        return self.end.exit_code

    @property
    def control_addr(self) -> str:
        return self.control.address

    @property
    def recovery(self) -> RecoveryRound | None:
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

    def read_messages(self, agents_only: bool = False) -> int:
        """Handle the control messages waiting; how many were agents' (:meth:`ControlPlane.read`)."""
        agents = self.control.read(agents_only=agents_only, stop=lambda: self.exit_code is not None)
        if self.control.drained:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = self.clock()
        return agents

    def heard_until(self, now: float) -> float:
        """The time up to which this coordinator has read what arrived: ``now``, or, while frames
        have waited unread since a read left some (a start's or a round's thousands of frames), the
        time that began. Silence and hangs are judged up to it: a beat waiting in the queue is no
        silence of its sender (at 16,384 ranks a node was taken for lost while its beats waited
        behind the start's hellos; docs/scale.md)."""
        return now if self.behind_since is None else min(now, self.behind_since)

    def finish_with(self, code: int | None) -> None:
        """Record the job's exit code, once decided (``None``: not decided)."""
        self.end.finish_with(code)

    def restart_job(self, reason: str) -> int | None:
        """Restart every rank (:meth:`JobEnd.restart_job`)."""
        return self.end.restart_job(reason)

    def stop(self, code: int, reason: str) -> int:
        """Stop the job with exit code ``code`` (:meth:`JobEnd.stop`)."""
        return self.end.stop(code, reason)

    def collect_reports(self, stopping: bool = False) -> list[Rank]:
        """Apply the agents' reports (:meth:`Failures.collect_reports`); the ranks that failed."""
        return self.failures.collect_reports(stopping)

    def on_failure(self, failed: list[int], kind: str = "death") -> int | None:
        """Act on ranks that failed (:meth:`Failures.on_failure`)."""
        return self.failures.on_failure(failed, kind)

    def check_hangs(self) -> None:
        """Act on what the watchdog finds (:meth:`Failures.check_hangs`)."""
        self.failures.check_hangs()

    def declare_hung(self, r: Rank, hung: Hung) -> None:
        """Kill a hung rank after its stacks are dumped (:meth:`Failures.declare_hung`)."""
        self.failures.declare_hung(r, hung)

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
        """Publish the status (:meth:`ftrun.coordinator.publish.Publisher.status`), unless a young
        recovery round of a large job goes first (:data:`ROUND_STATUS_HOLD_S`)."""
        rec = self.rounds.current
        if (not force and final is None and rec is not None and status_gap(len(self.ranks)) > STATUS_PERIOD_S
                and self.clock() - rec.round_started < ROUND_STATUS_HOLD_S):
            return
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
        if takeover is None:
            self.start_job()
        else:
            self.take_over(takeover, lost, cause)
        with self.collector.armed():
            self._loop()
        code, message = self.end.final()
        self.publish_status(final={"exit_code": code, "message": self.end.final_message or ""})
        for agent in [*self.agents.values(), *self.members.standby_nodes.values()]:
            agent.shutdown(code, message)
        self.close()
        return code

    def start_job(self) -> None:
        """Announce the job (``job_started``, the configuration's warnings), publish the control
        endpoint and start its first attempt."""
        spec = self.spec
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

    def _loop(self) -> None:
        """Turn until the job's end is decided: wake on a control message, a closed connection, a
        signal, or every ``--monitor_interval`` seconds; each check of a turn runs while the end is
        not decided, and the status is published after each turn.

        Every turn reads the frames waiting. The checks that look at every node or rank run when
        there is news for them: the agents' reports and node checks after a signal (``SIGCHLD``),
        a closed connection or an agent's message, and everything (the watchdog, the spares, the
        standbys' replica of the hard state included) once per ``--monitor_interval``
        (:meth:`_scan_due`), not on every wake-up: at thousands of ranks frames arrive thousands of
        times a second, and a pass over every rank per frame would cost O(ranks) each (docs/scale.md)."""
        poller = zmq.Poller()
        poller.register(self.control.router, zmq.POLLIN)
        poller.register(self.control.disconnects, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        agent_news = False  # agents' messages read in the last turn: their reports wait
        while self.exit_code is None:
            ready = dict(poller.poll(timeout=int(self.spec.monitor_interval * 1000)))
            self.collector.hold()
            signalled = self._wakeup.drain()
            if self.stop_signal is not None:
                self.finish_with(self.end.stop(128 + self.stop_signal, f"stopped by {signal.Signals(self.stop_signal).name}"))
                break
            due = self._scan_due()
            scans = self._scans
            news = due or signalled or agent_news or self.control.disconnects in ready
            if news:
                self.finish_with(self.check_processes())
            if self.exit_code is None:
                agent_news = self.read_messages() > 0
            if self.exit_code is None and (news or agent_news):
                self.finish_with(self.check_agents())
            if self.exit_code is None and due and self._scans == scans:  # not put off by a round begun meanwhile
                self.rounds.plan_when_reported()  # a rank that left the job is awaited no more
                self.rounds.finish_when_recovered()
                self.check_hangs()
                if self.exit_code is None:
                    self.spawning.keep_spares()
                if self.exit_code is None:
                    self.failover.replicate(self.clock())
                self.collector.freeze_when_due()
            self.publish_status()

    def _scan_due(self) -> bool:
        """Whether the passes over every rank are due: ``--monitor_interval`` seconds (the job's
        clock) after the last ones, or one second per :data:`SCAN_RANKS_PER_S` ranks in a larger
        job (16,384 ranks: every 0.82 s), so that their share of a core stays bounded: one pass of
        the watchdog over 16,384 ranks costs 5 ms of CPU in a process of its own, several times
        that beside 2,048 agents' frames a second, and every timeout it checks is seconds long
        (docs/scale.md)."""
        now = self.clock()
        if now - self._scanned_at < max(self.spec.monitor_interval, len(self.ranks) / SCAN_RANKS_PER_S):
            return False
        self._scanned_at = now
        self._scans += 1
        return True

    def scanned(self) -> None:
        """The passes over every rank are put off a whole period: a round that just sent every
        rank its order has no report yet, replicated its state, and restarted the watchdog's
        clocks (at 16,384 ranks, 25 ms of CPU saved between the abort and its answers)."""
        self._scanned_at = self.clock()
        self._scans += 1

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
        return (self.end.finish_failed(found.reason) if isinstance(found, NoReplacement) else self.end.step_down(found)
                if isinstance(found, QuorumLost) else self.failures.node_lost(found) if isinstance(found, NodeLoss) else None)

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
                self.finish_with(self.failures.node_lost(NodeLoss(node, f"node {node} lost {what}: {cause}", "coordinator_lost")))

    def on_agent_message(self, identity: bytes, msg: Message, fd: int | None = None) -> None:
        """An agent's message (:meth:`Membership.on_agent_message`); a replacement's hello while
        the old agent is silent first makes the old one's node lost."""
        loss = self.members.on_agent_message(identity, msg, fd)
        if loss is not None:
            self.finish_with(self.failures.node_lost(loss))
            if self.exit_code is None:
                self.members.on_agent_message(identity, msg, fd)  # now awaited: accepted

    def check_processes(self) -> int | None:
        """Apply the agents' reports and act on failures. Returns the job's exit code once it ends."""
        newly_failed = self.failures.collect_reports()
        result = (self.failures.on_failure([r.rank for r in newly_failed]) if newly_failed
                  else self.failures.settle_startup() if self.failures.startup.held else None)
        if result is not None:
            return result
        self.release_finish_barrier()  # a rank may have exited 0 without ft.finish(), or a recovery ended
        if all(r.proc.state == RankState.SUCCEEDED for r in self.ranks.values()):
            return self.end.succeeded()
        if self.spec.join and any(r.proc.state == RankState.FAILED for r in self.ranks.values()):
            if all(not r.alive() for r in self.ranks.values()):
                return self.end.finish_failed("a rank failed and --join let the others finish")
        return None


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

"""A rank's failure, from the evidence to the policy's decision carried out.

The evidence comes from the node agents' reports (a rank's exit, a stop by a signal, the stacks
of a hung rank), from the watchdog's verdicts (:mod:`.watchdog`) and from node losses
(:mod:`.membership`). :class:`Failures` records each failure, gathers the facts a decision
depends on (:class:`ftrun.coordinator.policy.FailureFacts`), asks the policy
(:func:`ftrun.coordinator.policy.decide_failure`) and carries out its answer: a recovery round
(:mod:`.rounds`), a whole-job restart or the job's end (:mod:`.ending`).
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any, Sequence

from ftrun.common import procs
from ftrun.common.events import EventKind
from ftrun.coordinator.agents import SpareNote, Spawned, StandbyOffer, Stacks
from ftrun.coordinator.membership import NodeLoss
from ftrun.coordinator.phases import JobPhase
from ftrun.coordinator.policy import (Action, Decision, FailedRank, FailureFacts, RankState, StartupFailures,
                                      decide_failed_ranks, decide_failure)
from ftrun.coordinator.ranks import Failure, Rank
from ftrun.coordinator.watchdog import CommHang, Hung, Unrepaired
from ftrun.node.spawner import ExitReport, StopReport

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

log = logging.getLogger("ftrun.coordinator")

ACTIVE = (JobPhase.RUNNING, JobPhase.RECOVERING)  # phases in which a failure is acted on

#: In a job of more ranks than this, the watchdog walks the rank table at most once per this many
#: ranks a second (16,384 ranks: every 2 s), not at every pass of the main loop's checks (every
#: 0.82 s there): a walk over 16,384 ranks cost 19 ms beside 2,048 agents' frames a second, a tenth
#: of the coordinator's busy time in steady state, and every bound it checks is seconds long (the
#: heartbeat timeout, a step or section timeout, a round's deadline), so a hang is found at most
#: 2 s later at that size (docs/scale.md).
WATCHDOG_RANKS_PER_S = 8192


class Failures:
    """Detect failures and act on them.

    Args:
        job: the coordinator (its spec, clocks, rank table, agents, state, events and roles).
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.startup = StartupFailures(job.spec.worker_num)  # failures before ftrun.init, held to see if all fail alike
        self.hung: dict[tuple[int, int], tuple[Any, ...]] = {}  # (rank, incarnation) -> what the watchdog saw
        self._inspected_at = float("-inf")  # the watchdog's last walk (the job's clock)

    # ----------------------------------------------------------------- evidence: the agents' reports
    def collect_reports(self, stopping: bool = False) -> list[Rank]:
        """Take every agent's reports (spawned, exited, stopped, stacks) and apply them; return the
        ranks that failed (exited non-zero) in them. With ``stopping`` (every rank is being
        stopped), or from a node that is leaving the job, an exit is recorded, not a failure."""
        job = self.job
        newly_failed: list[Rank] = []
        for agent in list(job.agents.values()):
            for report in agent.take_reports():
                if isinstance(report, SpareNote):
                    job.emit(EventKind.WARNING, f"node {agent.node}: {report.message}", fault="hot_spare_contract")
                    continue
                if isinstance(report, StandbyOffer):
                    job.failover.on_standby(agent.node, report.control, report.store)
                    continue
                r = job.ranks.get(report.rank)
                if r is None or report.incarnation != r.incarnation:
                    continue  # an older process of the rank: nothing to act on
                if isinstance(report, Spawned):
                    job.spawning.on_spawned(r, report.pid, report.spare)
                elif isinstance(report, Stacks):
                    self.on_stacks(r, report)
                elif isinstance(report, StopReport) and r.alive() and r.proc.kill_reason is None and not stopping:
                    self.on_stopped(r, report)
                elif isinstance(report, ExitReport) and r.alive() and (stopping or agent.leaving):
                    r.proc.running = False  # a stop, or its node is leaving the job (a node loss, handled as one)
                    r.proc.exit_code, r.proc.exit_desc = procs.describe_exit(report.returncode)
                elif isinstance(report, ExitReport) and r.alive() and self.on_exit(r, report):
                    newly_failed.append(r)
        return newly_failed

    def on_stopped(self, r: Rank, report: StopReport) -> None:
        """Frozen by a signal: its parent saw it at once; no need to wait for the heartbeats."""
        try:
            name = signal.Signals(report.signal).name
        except ValueError:
            name = f"signal {report.signal}"
        job = self.job
        self.declare_hung(r, Hung(r.rank, "stopped", f"stopped by {name} (seen by its parent at once)",
                                  job.clock() - max(0.0, job.wall() - report.at)))

    def on_exit(self, r: Rank, report: ExitReport) -> bool:
        """Record a rank's exit; True when it failed."""
        job, p = self.job, r.proc
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
            p.move(RankState.SUCCEEDED)
            job.emit(EventKind.RANK_EXITED, f"rank {r.rank} finished ({desc})", rank=r.rank, exit_code=0)
            return False
        p.move(RankState.FAILED)
        wall = job.wall()
        # detection: from the evidence (the SIGCHLD's arrival, or the hang's start) to now
        detection = job.clock() - p.hung_since if p.kill_reason is not None else wall - report.at
        failure = Failure(r.rank, p.pid, code, desc, wall, detection_seconds=max(0.0, detection), log_tail=tuple(report.log_tail))
        job.state.record_failure(failure)
        job.emit(EventKind.RANK_FAILED,
                 f"rank {r.rank} failed: {desc} (pid {p.pid}, step {p.step}{f', node {r.node}' if job.spec.nnodes > 1 else ''})",
                 rank=r.rank, exit_code=code, cause=desc, step=p.step, committed=p.committed, node=r.node, detected_at=wall,
                 detection_seconds=round(failure.detection_seconds, 4),
                 **({"log_tail": list(report.log_tail)} if report.log_tail else {}))
        return True

    # ----------------------------------------------------------------- evidence: hangs
    def check_hangs(self) -> None:
        """Act on what the watchdog finds (:meth:`Watchdog.inspect`); in a job of more than
        :data:`WATCHDOG_RANKS_PER_S` ranks, at most once per that many ranks a second."""
        job = self.job
        now, ranks = job.clock(), len(job.ranks)
        if ranks > WATCHDOG_RANKS_PER_S and now - self._inspected_at < ranks / WATCHDOG_RANKS_PER_S:
            return
        self._inspected_at = now
        heard = job.heard_until(now)  # what waits unread is no silence (Coordinator.heard_until)
        found = job.watchdog.inspect(job.ranks.values(), job.rounds.current, bool(job.state.round_failures),
                                     set(job.agents), heard, job.members.quiet_nodes(heard))
        if isinstance(found, Unrepaired):
            job.end.finish_with(job.end.restart_job(found.reason))
        elif isinstance(found, CommHang):
            job.emit(EventKind.WARNING, f"communication hang: {found.reason}", fault="comm_hang")
            if job.spec.tft.hcce and job.spec.tft.arf:
                job.rounds.start(set(), found.reason, kind="comm_error")
            else:
                job.end.finish_with(job.end.restart_job(f"communication hang ({found.reason}) and HCCE is off"))
        elif found:
            for hung in found:
                self.declare_hung(job.ranks[hung.rank], hung)

    def declare_hung(self, r: Rank, hung: Hung) -> None:
        """Have the rank's agent dump its stacks into its log and SIGKILL it (then it is recovered
        as a death); the ``rank_hung`` event follows, with the stacks, when the agent reports."""
        job, p = self.job, r.proc
        p.kill_reason, p.hung_since = f"hung: {hung.evidence}", hung.since
        self.hung[(r.rank, r.incarnation)] = (hung.kind, hung.evidence, p.step, p.phase.value,
                                              round(job.clock() - p.last_heartbeat, 3) if p.identity is not None else None)
        agent = job.agents.get(r.node)
        if agent is not None:
            # Only the worker library installs the SIGUSR1 stack dump; SIGUSR1 would kill any other script.
            agent.kill_hung(r.rank, r.incarnation,
                            f"===== ftrun: rank {r.rank} (pid {p.pid}) hung: {hung.evidence}; {{note}}; killing it =====",
                            dump=r.library)

    def on_stacks(self, r: Rank, report: Stacks) -> None:
        kind, evidence, step, phase, heartbeat_age = self.hung.pop(
            (r.rank, report.incarnation), ("unknown", "", r.proc.step, r.proc.phase.value, None))
        where = self.job.log_dir / f"worker_{r.rank}.log"
        self.job.emit(EventKind.RANK_HUNG, f"rank {r.rank} hung: {evidence}; {report.note}", rank=r.rank, fault=kind,
                      evidence=evidence, step=step, phase=phase, heartbeat_age=heartbeat_age,
                      stack_dump=(str(where) + (f" on node {r.node}" if r.node else "")) if report.lines else None,
                      stacks=report.lines[-80:])

    # ----------------------------------------------------------------- evidence: a lost node
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
        job, node, reason = self.job, loss.node, loss.reason
        job.members.lose(node, reason)
        now, wall = job.clock(), job.wall()
        lost = [r for r in job.ranks.values() if r.node == node and r.proc.state != RankState.SUCCEEDED]
        for r in lost:
            r.proc.running = False
            r.proc.exit_code, r.proc.exit_desc = 1, reason
            r.proc.move(RankState.FAILED)
            job.state.record_failure(Failure(r.rank, r.proc.pid, 1, reason, wall, detection_seconds=loss.evidence_age))
        if job.phase.current not in ACTIVE:
            return None
        spec = job.spec
        waits = loss.replaceable and spec.tft.arf and bool(lost) and not spec.join
        job.emit(EventKind.NODE_LOST, reason + ("; a standby node takes it" if waits and job.members.standby_nodes else
                                                f"; waiting up to {spec.node_wait_timeout:g} s for a replacement "
                                                f"launcher with --node_rank {node}" if waits else ""),
                 node_lost=node, ranks=[r.rank for r in lost], waiting=waits, cause=loss.cause,
                 detection_seconds=round(loss.evidence_age, 4))
        if not waits:
            return job.end.finish_failed(reason)
        job.members.await_replacement(node, reason, now)
        return self.on_failure([r.rank for r in lost], kind="node_loss")

    # ----------------------------------------------------------------- the policy's decision, carried out
    def facts(self, failed: Sequence[int], kind: str) -> FailureFacts:
        """What the policy decides on about ranks ``failed`` (``kind``: death, or node_loss), as the
        job stands now."""
        job = self.job
        spec, now, ranks = job.spec, job.clock(), job.ranks
        others = [r for r in ranks.values() if r.rank not in failed]
        return FailureFacts(
            failed=tuple(FailedRank(f, ranks[f].proc.exit_code, ranks[f].proc.exit_desc, ranks[f].library,
                                    ranks[f].proc.finished, ranks[f].started_up(now)) for f in failed),
            world_size=spec.worker_num, arf=spec.tft.arf, library_ranks=tuple(r.rank for r in ranks.values() if r.library),
            restarts_used=job.state.restarts_used, max_restarts=spec.max_restarts, one_event=kind == "node_loss",
            join=spec.join, active=job.phase.current in ACTIVE,
            moving_home=bool(failed) and all(rank in job.elastic.going_home for rank in failed),
            unusable_checkpoint=job.ttp.unusable() is not None,
            others_succeeded=bool(others) and all(r.proc.state == RankState.SUCCEEDED for r in others),
            others_started_up=any(r.started_up(now) for r in others), startup_held=self.startup.held)

    def on_failure(self, failed: list[int], kind: str = "death") -> int | None:
        """Ranks failed (``kind``: death, or node_loss): respawn them (ARF), restart the job, or fail
        it (:func:`ftrun.coordinator.policy.decide_failure`). While the job is already restarting or
        ending, the failure is only recorded. Failures before ``ftrun.init`` may be held a few seconds
        (:class:`ftrun.coordinator.policy.StartupFailures`: does every rank fail alike?)."""
        facts = self.facts(failed, kind)
        decision = decide_failure(facts)
        if decision.action == Action.HOLD:
            held = self.startup.hold(facts.early_exits(), self.job.clock(), facts.hello())
            if held is None:
                return None
            decision = decide_failed_ranks(self.facts(sorted({*failed, *held}), kind))
        return self.carry_out(decision, kind)

    def settle_startup(self) -> int | None:
        """Decide on failures before ``ftrun.init`` once held long enough (:meth:`on_failure`)."""
        job = self.job
        found = self.startup.settle(now := job.clock(), any(r.started_up(now) for r in job.ranks.values() if r.rank not in self.startup.exits),
                                    sum(r.alive() for r in job.ranks.values()))
        if found is None or job.phase.current not in ACTIVE:
            return None
        if found[1]:
            return job.end.finish_failed(found[1])
        return self.carry_out(decide_failed_ranks(self.facts(found[0], "death")), "death")

    def carry_out(self, decision: Decision, kind: str) -> int | None:
        """Do what the policy decided; the job's exit code once it ends."""
        job = self.job
        if decision.action == Action.RECORD:
            return None
        if decision.action == Action.MOVE_HOME:  # stopped to move back to their node, which joined: no restart spent
            job.elastic.home(list(decision.ranks))
            return job.rounds.start(set(decision.ranks), decision.reason, kind="grow")
        if decision.action == Action.FAIL_JOB:
            return job.end.finish_failed(decision.reason)
        if decision.action == Action.RESPAWN_RANKS:
            job.rounds.start(set(decision.ranks), decision.reason, kind=kind)
            return None
        return job.end.restart_job(decision.reason)

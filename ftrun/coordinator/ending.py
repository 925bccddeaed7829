"""How an attempt of the job ends: a whole-job restart, the job's failure, a stop, or this
coordinator stepping down; the job's exit code and final message.

Its exit code is the job's: 0, the root-cause rank's exit code (128+N for signal N), 130/143 when
stopped by SIGINT/SIGTERM, or 1 for a coordinator that stepped down.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ftrun.common.events import EventKind
from ftrun.common.stores import StoreBindError
from ftrun.coordinator.agents import RemoteAgent
from ftrun.coordinator.membership import QuorumLost
from ftrun.coordinator.phases import JobPhase
from ftrun.coordinator.policy import Action, RankState, decide_restart
from ftrun.coordinator.ranks import first_failure_tail

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

STOP_REPORT_WAIT_S = 10.0  # past the grace period: how long stopped ranks' exits are waited for
ACTIVE = (JobPhase.RUNNING, JobPhase.RECOVERING)  # phases in which a restart is acted on


class JobEnd:
    """Restarts and ends the job, and keeps its exit code once decided.

    Args:
        job: the coordinator (its spec, rank table, agents, state, checkpoints, events).
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.exit_code: int | None = None  # set once the job's end is decided
        self.final_message: str | None = None

    def finish_with(self, code: int | None) -> None:
        """Record the job's exit code, once decided (``None``: not decided)."""
        if code is not None and self.exit_code is None:
            self.exit_code = code

    def succeeded(self) -> int:
        """Every rank exited 0."""
        job = self.job
        self.final_message = "job succeeded"
        job.phase.move(JobPhase.FINISHED)
        job.emit(EventKind.JOB_FINISHED, "job succeeded", exit_code=0, restarts=job.state.restarts_used)
        return 0

    def restart_job(self, reason: str) -> int | None:
        """Stop every rank and start them all again (torchrun semantics), from the newest checkpoint
        (a dying-gasp one if the live ranks could write it); :func:`ftrun.coordinator.policy.decide_restart`
        says whether it spends a restart or the job fails."""
        job = self.job
        if job.phase.current not in ACTIVE:
            return None
        unusable = job.ttp.unusable()
        if unusable is not None:
            assert job.ttp.resume_from is not None
            unusable_why = f"checkpoint {job.ttp.resume_from.directory} is unusable: {unusable[0]} {unusable[1]}"
        decision = decide_restart(reason, restarts_used=job.state.restarts_used, max_restarts=job.spec.max_restarts,
                                  unusable=unusable_why if unusable is not None else None)
        if decision.action == Action.FAIL_JOB:
            return self.finish_failed(decision.reason)
        reason = decision.reason
        if decision.counts_restart:
            job.ttp.dying_gasp(reason)
            job.state.spend_restarts(1)
        job.phase.move(JobPhase.RESTARTING)
        job.emit(EventKind.JOB_RESTARTING, f"restarting all ranks: {reason} (restart {job.state.restarts_used}/{job.spec.max_restarts})",
                 reason=reason, restarts_used=job.state.restarts_used)
        self.stop_all_ranks()
        for r in job.ranks.values():
            if r.proc.exit_code is None:
                r.proc.move(RankState.STOPPED)
            r.restarts += 1
            r.library = False
        job.rounds.current = None
        job.failures.startup.new_attempt()
        job.state.new_attempt()
        try:
            job.start_attempt()
        except StoreBindError as err:  # no port left for the new attempt's store (every ephemeral port in use)
            return self.finish_failed(f"cannot restart the job: the new attempt's rendezvous store cannot listen on "
                                      f"{job.spec.master_addr} ({err.strerror}); free ports on node 0, then run the "
                                      f"same command again")
        job.phase.move(JobPhase.RUNNING)
        return None

    def stop_all_ranks(self) -> None:
        """Stop every rank on every node (SIGTERM, SIGKILL after ``--grace_period``) and wait until
        each exit is reported, at most :data:`STOP_REPORT_WAIT_S` seconds past the grace period
        (a rank whose node is lost is taken as stopped). Exits seen here are stops, not failures."""
        job = self.job
        job.members.pending_spawns.clear()
        for agent in job.agents.values():
            agent.stop_ranks(job.spec.grace_period)
        deadline = time.monotonic() + job.spec.grace_period + STOP_REPORT_WAIT_S
        while True:
            job.failures.collect_reports(stopping=True)
            for r in job.ranks.values():
                agent = job.agents.get(r.node)
                if r.alive() and (agent is None or not agent.connected()):
                    r.proc.running = False  # nobody left to stop it or to tell
            if not any(r.alive() for r in job.ranks.values()) or time.monotonic() > deadline:
                return
            if job.control.router.poll(timeout=50):
                job.read_messages(agents_only=True)

    def _stop_the_rest(self) -> None:
        """Stop every rank, and mark those that had not ended as stopped; the job is finished."""
        job = self.job
        self.stop_all_ranks()
        for r in job.ranks.values():
            if r.proc.state not in (RankState.SUCCEEDED, RankState.FAILED):
                r.proc.move(RankState.STOPPED)
        job.phase.move(JobPhase.FINISHED)

    def _wind_down(self, reason: str) -> str:
        """The common end of a failed or stopped job: a dying gasp, every rank stopped; returns the
        resume hint for the final message."""
        job = self.job
        job.ttp.dying_gasp(reason)
        job.phase.move(JobPhase.STOPPING)
        hint = job.ttp.resume_hint()
        self._stop_the_rest()
        return hint

    def finish_failed(self, reason: str) -> int:
        """End the job as failed; the exit code is the root cause's (the first failure of the last round)."""
        job = self.job
        hint = self._wind_down(reason)
        root = (job.state.round_failures or job.state.failures)[0]
        tail, same = first_failure_tail(job.state.failures, root.rank, job.log_dir)
        self.final_message = f"job failed: {reason}; root cause: rank {root.rank} ({root.description}){same}{hint}"
        job.emit(EventKind.JOB_FINISHED, self.final_message, rank=root.rank, pid=root.pid, exit_code=root.exit_code,
                 reason=reason, root_cause={"rank": root.rank, "pid": root.pid, "exit_code": root.exit_code,
                                            "cause": root.description},
                 log_tail=tail, restarts=job.state.restarts_used)
        return root.exit_code

    def stop(self, code: int, reason: str) -> int:
        """Stop the job (a signal, a divergence under ``--on_divergence fail``) with exit code ``code``."""
        job = self.job
        job.emit(EventKind.STOP_REQUESTED, f"{reason}: stopping all ranks (grace {job.spec.grace_period:g} s)")
        self.final_message = f"job {reason}{self._wind_down(reason)}"
        job.emit(EventKind.JOB_FINISHED, self.final_message, exit_code=code, reason=reason)
        return code

    def step_down(self, lost: QuorumLost) -> int:
        """This coordinator lost its quorum (:meth:`Membership.quorum`): stop this side of the
        job without a dying gasp (the standby may go on with it: a checkpoint written here would
        race the job's), and end with exit code 1. Agents and ranks that moved to the standby
        never come back here: their old connections are closed, and the new coordinator's epoch
        is higher."""
        job = self.job
        reason = f"node {job.spec.node_rank} stepped down as the job coordinator (epoch {job.state.epoch}): {lost.reason}"
        job.emit(EventKind.COORDINATOR_STEPPED_DOWN, reason, node=job.spec.node_rank, epoch=job.state.epoch)
        job.phase.move(JobPhase.STOPPING)
        for node, agent in list(job.agents.items()):
            if isinstance(agent, RemoteAgent):  # out of reach: those ranks are the other side's now
                del job.agents[node]
        self._stop_the_rest()
        self.final_message = f"{reason}; this node's ranks were stopped and it leaves the job"
        job.emit(EventKind.JOB_FINISHED, self.final_message, exit_code=1, reason=lost.reason, fenced=True)
        return 1

    def final(self) -> tuple[int, str]:
        """The job's exit code and its final message, once the job ended."""
        assert self.exit_code is not None
        return self.exit_code, self.final_message or f"job finished with exit code {self.exit_code}"

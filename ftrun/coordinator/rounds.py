"""ARF recovery rounds (MindSpore's process-level rescheduling): respawn only the failed ranks and
orchestrate the state transfer to them, or repair the group in place (HCCE, UCE).

A round is one generation: the failed ranks are respawned, every survivor is aborted to a safe
point and reports its committed step; once every live rank has reported, :func:`ftrun.coordinator.policy.plan_recovery`
chooses the step to resume from and the donor of each recipient's state, and every live rank is
sent the plan; the round ends when every live rank says it carried it out. A fault during a round
starts the next round (the next generation), keeping the first failure's start time.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Iterable

from ftrun.common.events import EventKind
from ftrun.coordinator.policy import (NO_STATE, NoLiveReplica, RankState, default_replica_groups, plan_recovery, plan_rollback,
                                     rank_ranges, redone_steps, replica_groups_from_hello, respawn_restarts)
from ftrun.common.protocol import Message, MsgType
from ftrun.coordinator.phases import JobPhase
from ftrun.coordinator.ranks import Rank, RankPhase, RecoveryRound

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

#: A round whose plan moves state to more ranks than this (a laggard rule over thousands of ranks, a
#: rollback of every rank) has a ``rank_recovered`` event for its respawned ranks only: one per rank
#: was thousands of events (each written, pushed to the console and counted) at 16,384 ranks; the
#: ``recovery_finished`` event has the round's totals.
RANK_EVENTS_MAX = 256

#: The moves a round's start makes without Incarnation.move (allowed by RANK_TRANSITIONS; a test says so).
_HEALTHY, _RECOVERING = RankState.HEALTHY, RankState.RECOVERING
_KIND_LABEL = {"comm_error": "HCCE: communication error", "recoverable_error": "UCE: recoverable error"}


def committed_detail(reports: dict[int, int]) -> dict[str, Any]:
    """The ``recovery_planned`` event's account of the reports it was planned from: each rank's
    committed step (``committed``: rank -> step), or above :data:`RANK_EVENTS_MAX` ranks the ranks
    at each step (``committed_ranks``: step -> ranks as ranges, "0-4095,4097"): a rank's entry
    each was a line of 300 KB, written and pushed, at 16,384 ranks."""
    if len(reports) <= RANK_EVENTS_MAX:
        return {"committed": dict(sorted((str(k), v) for k, v in reports.items()))}
    at: dict[int, list[int]] = {}
    for rank, step in reports.items():
        ranks = at.get(step)
        if ranks is None:
            ranks = at[step] = []
        ranks.append(rank)
    return {"committed_ranks": {str(step): rank_ranges(ranks) for step, ranks in sorted(at.items())}}


class RecoveryRounds:
    """The recovery in progress (:attr:`current`, None between recoveries) and its rounds.

    Args:
        job: the coordinator (its spec, clock, rank table, spawning, events and restart policy).
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.current: RecoveryRound | None = None
        # the replica groups last built, and what each rank had declared then (replica_groups)
        self._groups: tuple[tuple[tuple[int, ...], ...], list[list[int]]] | None = None

    def start(self, failed: set[int], reason: str, kind: str = "death") -> None:
        """Begin (or restart) a recovery round: respawn ``failed`` and ask survivors to report.

        ``kind`` names the fault for the events: death, hang, comm_error (HCCE) or
        recoverable_error (UCE); the last two respawn nothing.
        """
        job = self.job
        job.collector.hold(starting=True)  # no collection in the round's path (ftrun.coordinator.collector)
        now = job.clock()
        job.phase.move(JobPhase.RECOVERING)
        job.state.next_generation()
        job.failover.replicate(now, force=True)  # the standby knows the generation before any rank does
        rec = self.current
        if rec is None:
            detection = max((f.detection_seconds for f in job.state.round_failures if f.rank in failed), default=0.0)
            rec = self.current = RecoveryRound(generation=job.generation, started_at=now - detection, failed=set(failed),
                                          detection_seconds=detection, round_started=now)
            job.emit(EventKind.RECOVERY_STARTED,
                     f"recovery of rank(s) {sorted(failed)} started: generation {job.generation}" if failed
                     else f"{_KIND_LABEL.get(kind, kind)}: {reason}; rebuilding the group (generation {job.generation}), no respawn",
                     failed=sorted(failed), reason=reason, fault=kind)
        else:
            rec.generation = job.generation
            rec.failed |= failed
            rec.reports.clear()
            rec.plan = None
            rec.recovered.clear()
            rec.unreported = rec.unrecovered = None
            rec.rounds += 1
            rec.round_started = now
            why = f"rank(s) {sorted(failed)} failed during recovery" if failed else reason
            job.emit(EventKind.RECOVERY_STARTED, f"recovery restarted (round {rec.rounds}): {why}; generation {job.generation}",
                     failed=sorted(failed), reason=reason, round=rec.rounds, fault=kind)
        if kind != "grow":  # ranks moving back to a node that joined again spend nothing (ftrun.coordinator.elastic)
            job.state.spend_restarts(respawn_restarts(failed, one_event=kind == "node_loss"))  # a node's loss: one event
        for rank in sorted(failed):
            r = job.ranks[rank]
            r.restarts += 1
            job.spawn(r, use_spare=True)
            rec.respawned_at[rank] = job.clock()
            job.emit(EventKind.RANK_RESPAWNED,
                     f"rank {rank} respawned as incarnation {r.incarnation} (restart {job.restarts_used}/{job.spec.max_restarts})",
                     rank=rank, restarts_used=job.restarts_used)
        survivors = []
        for r in job.ranks.values():  # every rank, in the path of the round's abort: alive() and move() inlined
            p = r.proc
            if p.running and r.rank not in failed:
                survivors.append(r)
                if p.state is _HEALTHY or p.state is _RECOVERING:  # the usual moves, which RANK_TRANSITIONS allows
                    p.state = _RECOVERING
                else:
                    p.move(_RECOVERING)
        self.send_order(survivors, MsgType.ABORT, {"generation": job.generation, "reason": reason})
        job.failover.ranks_heard(now)  # the respawned ranks hear the standbys at their hello
        job.scanned()

    def send_order(self, ranks: list[Rank], order: MsgType, common: dict[str, Any],
                   own: dict[int, dict[str, Any]] | None = None) -> None:
        """Send ``ranks`` a round's ``order`` (``common`` fields, updated with ``own[rank]``). A rank
        whose relayed beats were read gets it through its node's agent, one frame a node
        (:mod:`ftrun.node.relay`); the others, straight."""
        job, own, none = self.job, own or {}, {}  # ``none``: the own fields of a rank without any (never changed)
        mine = own.get
        by_node: dict[int, list[list[Any]]] = {}
        for r in ranks:  # every rank at every coordinator's beat: written for speed (docs/scale.md)
            p = r.proc
            if p.relayed and p.identity is not None:
                try:
                    by_node[r.node].append([r.rank, p.number, mine(r.rank, none)])
                except KeyError:  # the node's first rank
                    by_node[r.node] = [[r.rank, p.number, mine(r.rank, none)]]
            else:
                job.send(r, order, **{**common, **mine(r.rank, none)})
        for node, rows in by_node.items():
            agent = job.members.agents.get(node)
            if agent is None or not agent.relay_orders(order, common, rows):
                for rank, _incarnation, fields in rows:
                    job.send(job.ranks[rank], order, **{**common, **fields})

    def on_report(self, r: Rank, generation: int, committed: int) -> None:
        """A live rank reports its committed step for this round (its hello, for a new one)."""
        self.on_reports(((r, generation, committed),))

    def on_reports(self, reports: Iterable[tuple[Rank, int, int]]) -> None:
        """Live ranks report their committed steps (rank, generation, step), in the order read;
        those of this round's generation are taken, and the plan is looked at after them (a node's
        answers at a time: every rank's, every round, written for speed)."""
        rec = self.current
        if rec is None:
            return
        generation, taken, unreported, took = rec.generation, rec.reports, rec.unreported, False
        for r, reported, committed in reports:
            if reported != generation:
                continue
            taken[r.rank] = committed
            took = True
            p = r.proc
            if p.state is not RankState.RECOVERING:  # a survivor was moved at the round's start
                p.move(RankState.RECOVERING)
            if unreported is not None:
                unreported.discard(r.rank)
        if took and rec.plan is None and not rec.unreported:
            self.plan_when_reported()

    def plan_when_reported(self) -> None:
        """Make the plan once every live rank has reported. A look over every rank, taken when the
        ranks missing at the last look have all reported, and once per pass of the main loop (a
        rank that left the job meanwhile is missing no more): one look per report would cost a
        round O(ranks²), minutes at 16,384 ranks (docs/scale.md)."""
        rec = self.current
        if rec is None or rec.plan is not None or not rec.reports:
            return
        live = [x.rank for x in self.job.ranks.values() if x.proc.running]  # alive(), inlined
        rec.unreported = {rank for rank in live if rank not in rec.reports}
        if not rec.unreported:
            self.make_plan(live)

    def on_hello(self, r: Rank, generation: int, seen: int | None = None) -> None:
        """A rank's process connected during a recovery: its hello is its report (it holds no
        state), or it is told the round's generation. ``seen``: a rank that moved here from a
        coordinator that died names the newest generation it heard of; a round at or below it
        would be ignored by that rank, so the next round goes beyond it."""
        rec = self.current
        assert rec is not None
        rec.joined_at.setdefault(r.rank, self.job.clock())
        if seen is not None and seen >= rec.generation:
            self.job.state.heard_of(seen)
            self.start(set(), f"rank {r.rank} had heard of generation {seen} from the coordinator before", kind="takeover")
            return
        if generation != rec.generation:
            self.job.send(r, MsgType.ABORT, generation=rec.generation, reason="recovery in progress")
        else:
            self.on_report(r, generation, NO_STATE)

    def make_plan(self, live: list[int]) -> None:
        job, rec = self.job, self.current
        assert rec is not None
        committed = {rank: rec.reports[rank] for rank in live}
        rollback: dict[str, Any] = {}
        try:
            groups = self.replica_groups()
            plan = plan_recovery(committed, groups)
        except NoLiveReplica as err:
            # No replica of a lost rank's state: every rank rolls back in place to the newest
            # checkpoint (its processes kept), or, without one, the job restarts as a whole.
            epochs = [x.rank for x in job.ranks.values() if x.alive() and not x.rollback_ok]
            if epochs:
                return self.fall_back(f"{err}, and rank {epochs[0]}'s epoch loop (ft.epochs, ft.batches) cannot be rolled "
                                      "back in place to a checkpoint")
            target = job.ttp.rollback_target()
            rolled = plan_rollback(committed, target[0] if target else None)
            if target is None or rolled is None:
                return self.fall_back(str(err))
            plan, rollback = rolled, {"rollback": str(target[1])}
            redone = redone_steps(committed, plan)
            job.emit(EventKind.RECOVERY_FALLBACK,
                     f"{err}: every rank rolls back in place to checkpoint {target[1]} (step {plan.step}; "
                     f"{redone} committed step(s) computed again), no whole-job restart",
                     reason=str(err), rollback=str(target[1]), step=plan.step, redone_steps=redone)
        except ValueError as err:
            return self.fall_back(str(err))
        rec.plan = plan
        rec.planned_at = job.clock()
        transfers = [[t.donor, t.recipient] for t in plan.transfers]
        job.emit(EventKind.RECOVERY_PLANNED,
                 f"generation {rec.generation}: resume at step {plan.step + 1}; "
                 + ("every rank loads checkpoint " + rollback["rollback"] if rollback else
                    "transfers " + (", ".join(f"{d}->{r}" for d, r in transfers) or "none")),
                 step=plan.step, transfers=transfers, **committed_detail(rec.reports), **rollback)
        # After a takeover the ranks' store is the new coordinator's (ftrun.coordinator.failover).
        store = {"store": f"{job.spec.master_addr}:{job.spawning.attempt_port}"} if job.epoch else {}
        # Each rank is sent the transfers it takes part in, which are all it acts on
        # (ftrun.rank.recovery): a plan's laggard rule can give thousands of ranks a transfer, and
        # the whole list to every rank was O(ranks x transfers) bytes (docs/scale.md).
        mine: dict[int, dict[str, Any]] = {}
        for pair in transfers:
            for rank in dict.fromkeys(pair):
                mine.setdefault(rank, {"transfers": []})["transfers"].append(pair)
        self.send_order([x for x in job.ranks.values() if x.proc.running], MsgType.RECONFIGURE,
                        {"generation": rec.generation, "world_size": job.spec.worker_num, "step": plan.step, "transfers": [],
                         **store, **rollback}, mine)
        job.failover.ranks_heard(rec.planned_at)

    def fall_back(self, reason: str) -> None:
        """ARF cannot recover (no live replica and no checkpoint to roll back to, or replica groups
        that do not fit): the job restarts as a whole."""
        self.job.emit(EventKind.RECOVERY_FALLBACK, f"ARF cannot recover: {reason}; falling back to a whole-job restart", reason=reason)
        self.job.finish_with(self.job.restart_job(f"no live replica ({reason})"))

    def replica_groups(self) -> list[list[int]]:
        """The job's replica groups, as the ranks declared them in their hello.

        Raises:
            ValueError: the declarations are not a partition of the ranks.
        """
        job = self.job
        # The declarations change only at a hello: the groups are built again only then (the
        # ranks of a group share one declaration object, compared by identity; building the
        # groups is 10 ms at 16,384 ranks, in the plan's path).
        key = tuple(x.replica_group for x in job.ranks.values())
        if self._groups is not None and len(key) == len(self._groups[0]) and all(map(operator.is_, key, self._groups[0])):
            return [list(g) for g in self._groups[1]]
        declared = {x.rank: x.replica_group for x in job.ranks.values() if x.replica_group}
        groups = (replica_groups_from_hello(job.spec.worker_num, declared) if declared
                  else default_replica_groups(job.spec.worker_num))
        self._groups = (key, groups)
        return [list(g) for g in groups]

    def on_recovered(self, r: Rank, msg: Message) -> None:
        """A rank carried out the plan (donor, recipient or neither); the last one ends the recovery."""
        self.on_recovered_ranks(((r, msg),))

    def on_recovered_ranks(self, answers: Iterable[tuple[Rank, Message]]) -> None:
        """Ranks carried out the plan (their ``recovered``, in the order read: a node's at a time,
        every rank's, every round, written for speed); the last one ends the recovery."""
        job, rec = self.job, self.current
        if rec is None or rec.plan is None:
            return
        now, took = job.clock(), False
        moved = len(job.ranks) if rec.plan.rollback else len(rec.plan.transfers)  # ranks whose state the plan moves
        for r, msg in answers:
            f = msg.fields  # read as a map
            if f["generation"] != rec.generation:
                continue
            took = True
            rec.recovered[r.rank] = dict(f, at=now)
            r.proc.move(RankState.HEALTHY)
            role = f["role"]
            if role != "none" and (r.rank in rec.failed or moved <= RANK_EVENTS_MAX):
                how = "rolled back to the checkpoint" if role == "rollback" else f"rejoined as {role}"
                job.emit(EventKind.RANK_RECOVERED, f"rank {r.rank} {how}: {f['bytes'] / 1e6:.2f} MB in {f['seconds']:.3f} s",
                         rank=r.rank, role=role, bytes=f["bytes"], seconds=f["seconds"], rebuild_seconds=f.get("rebuild_seconds"))
            if rec.unrecovered is not None:
                rec.unrecovered.discard(r.rank)
        if took and not rec.unrecovered:
            self.finish_when_recovered()

    def finish_when_recovered(self) -> None:
        """End the recovery once every live rank carried out the plan (looked at as
        :meth:`plan_when_reported` looks at the reports)."""
        rec = self.current
        if rec is None or rec.plan is None or not rec.recovered:
            return
        rec.unrecovered = {x.rank for x in self.job.ranks.values() if x.proc.running and x.rank not in rec.recovered}
        if not rec.unrecovered:
            self.finish(rec)

    def finish(self, rec: RecoveryRound) -> None:
        """Every live rank carried out the plan: the ``recovery_finished`` event with its costs."""
        job = self.job
        assert rec.plan is not None
        now = job.clock()
        redone = redone_steps(rec.reports, rec.plan)  # the reports the plan was made from
        total_bytes = sum(int(v["bytes"]) for v in rec.recovered.values() if v["role"] in ("recipient", "rollback"))
        transfer_s = max((float(v["seconds"]) for v in rec.recovered.values()), default=0.0)
        # Survivors wait inside the rebuild for the new rank; the last rank to arrive measures
        # the rebuild itself.
        rebuild_s = min((float(v.get("rebuild_seconds") or 0.0) for v in rec.recovered.values()), default=0.0)
        # Respawn: from the spawn to the new rank starting its rebuild (process start, imports,
        # the script's own set-up).
        # A rank of a lost node waits for its replacement's agent before its process can start:
        # that wait is the node's, not the respawn's.
        respawn_s: dict[str, Any] = {}
        node_wait_s: dict[str, Any] = {}
        for rank, t in rec.respawned_at.items():
            v = rec.recovered.get(rank, {})
            ready = float(v.get("at", now)) - float(v.get("rebuild_seconds") or 0.0) - float(v.get("seconds", 0.0))
            started = max(t, job.ranks[rank].proc.started_at)
            if started - t > 1e-3:
                node_wait_s[str(rank)] = round(started - t, 3)
            respawn_s[str(rank)] = round(ready - started, 3)
        node_wait = max(map(float, node_wait_s.values()), default=0.0)
        job.emit(
            EventKind.RECOVERY_FINISHED,
            (f"recovered rank(s) {sorted(rec.failed)}" if rec.failed else "repaired in place")
            + f" in {now - rec.started_at:.2f} s (detection "
            f"{rec.detection_seconds:.3f} s, " + (f"waiting for a replacement node {node_wait:.2f} s, " if node_wait_s else "")
            + f"respawn {max(map(float, respawn_s.values()), default=0.0):.2f} s, "
            f"group rebuild {rebuild_s:.2f} s, " + ("checkpoint load" if rec.plan.rollback else "transfer")
            + f" {transfer_s:.3f} s): resuming at step {rec.plan.step + 1}, "
            + (f"every rank rolled back to its checkpoint ({total_bytes / 1e6:.2f} MB loaded, {redone} committed "
               "step(s) to compute again)" if rec.plan.rollback else f"{total_bytes / 1e6:.2f} MB transferred"),
            failed=sorted(rec.failed), resume_step=rec.plan.step + 1, total_seconds=round(now - rec.started_at, 3),
            detection_seconds=round(rec.detection_seconds, 4), respawn_seconds=respawn_s, node_wait_seconds=node_wait_s,
            rebuild_seconds=round(rebuild_s, 3),
            transfer_seconds=round(transfer_s, 3), bytes=total_bytes, rounds=rec.rounds, redone_steps=redone,
        )
        self.current = None
        job.state.round_ended()
        job.phase.move(JobPhase.RUNNING)
        for x in job.ranks.values():
            x.proc.last_progress, x.proc.phase = now, RankPhase.COMPUTE

    def _killing(self) -> list[int]:
        """Ranks ftrun is killing (found hung) whose exit is not reported yet."""
        return [x.rank for x in self.job.ranks.values() if x.proc.running and x.proc.kill_reason is not None]

    def abort_answers(self, faults: list[tuple[Rank, Message]]) -> int:
        """How many of these ``fault`` messages (in the order read), from the first, answer this
        round's abort while it awaits its reports: :meth:`on_abort_answers` takes them together."""
        rec, lead = self.current, 0
        if rec is None or rec.plan is not None:
            return 0
        for _r, msg in faults:
            f = msg.fields
            if f.get("kind") != "abort" or f["generation"] != rec.generation:
                break
            lead += 1
        return lead

    def on_abort_answers(self, answers: list[tuple[Rank, Message]]) -> None:
        """Answers to this round's abort, before its plan (:meth:`abort_answers`: a node's relayed
        answers at a time; every rank's, every round): each is the rank's report, as in :meth:`on_fault`."""
        rec = self.current
        assert rec is not None
        for r, msg in answers:
            r.rollback_ok = msg.fields.get("rollback") is not False
        self.on_reports([(r, rec.generation, msg.fields["committed"]) for r, msg in answers])

    def on_fault(self, r: Rank, msg: Message) -> None:
        """A rank reports a failed collective, a recoverable error, or its answer to an abort."""
        job, rec, f = self.job, self.current, msg.fields  # ``f``: an answer to every abort; read as a map
        r.rollback_ok = f.get("rollback") is not False
        if rec is not None and rec.plan is None:  # the round awaits its reports: any fault is one
            self.on_report(r, f["generation"], f["committed"])
            return
        kind = f.get("kind", "comm")
        if rec is not None and rec.plan is not None and f["generation"] == rec.generation and kind == "abort":
            # An answer to this round's abort arriving after its plan: the rank's report was already
            # counted (a UCE rank's own report is its answer). Not a failure.
            return
        if rec is not None and rec.plan is not None and f["generation"] == rec.generation and job.spec.tft.arf:
            # The plan itself failed (a transfer or the new group broke) with no death seen: next round.
            self.start(set(), f"rank {r.rank} could not carry out the plan: {f['reason']}", kind="comm_error")
        elif rec is not None:
            self.on_report(r, f["generation"], f["committed"])
        elif f["generation"] == job.generation and kind == "comm" and self._killing():
            # ftrun is killing a hung rank: a collective with it fails on its closed connections
            # before its exit is reported. Its death starts the round, whose abort this rank answers;
            # an HCCE round now would only be restarted by that death (CI saw it).
            return
        elif f["generation"] == job.generation and kind in ("comm", "recoverable"):
            # No rank died (yet): repair in place, no respawn. UCE: the rank reloads from a replica.
            event_kind = "recoverable_error" if kind == "recoverable" else "comm_error"
            allowed = job.spec.tft.arf and (job.spec.tft.uce if kind == "recoverable" else job.spec.tft.hcce)
            reason = f"rank {r.rank} reported {f['reason']}"
            if not allowed:
                # A collective also fails when a peer dies, and its report can beat the peer's
                # SIGCHLD: wait a moment for a death before restarting the whole job.
                job.watchdog.note_unrepaired(job.clock(), f"{reason} and {'UCE' if kind == 'recoverable' else 'HCCE'} is off")
                return
            self.start(set(), reason, kind=event_kind)
            self.on_report(r, job.generation, f["committed"])

"""The ranks' messages: one handler per message type (a dispatch table), each recording what the
message says in the rank table or handing it to the role it concerns (recovery rounds, TTP).

A message must name a live rank and its current incarnation; every message but ``hello`` must come
from the connection whose ``hello`` was accepted for that incarnation (:meth:`RankMessages.handle`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ftrun.common.events import EventKind
from ftrun.coordinator.policy import RankState
from ftrun.common.protocol import RELAYED_ANSWERS, Message, MsgType, ProtocolError, relayed_message
from ftrun.coordinator.phases import JobPhase
from ftrun.coordinator.ranks import Incarnation, Rank, RankPhase, is_seconds

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

DIVERGENCE_EXIT_CODE = 3  # the job stopped on a detected divergence (--on_divergence fail)


class RankMessages:
    """Handles the ranks' control messages for the coordinator ``job``."""

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self._replica_groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # each declared group, one object

    def handle(self, identity: bytes, msg: Message) -> None:
        """Route one authenticated message of a rank to its handler (:attr:`_rank_handlers`).

        A message must name a live rank and its current incarnation; every message but ``hello``
        must come from the connection whose ``hello`` was accepted for that incarnation.
        """
        r = self.job.ranks.get(msg.get("rank")) if "rank" in msg.fields else None
        if r is not None and msg.type == MsgType.HELLO and self._adopts(r, msg):
            # After a takeover from a state that missed the dead coordinator's last decisions: a
            # process it started (a newer incarnation) says hello. It is the rank now; the one
            # the state names died with its node or was replaced.
            r.proc = Incarnation(number=int(msg["incarnation"]), started_at=self.job.clock(), running=True,
                                 state=RankState.RECOVERING, committed=r.proc.committed)
            self.job.emit(EventKind.WARNING, f"rank {r.rank}: incarnation {r.incarnation} (pid {msg['pid']}), started by "
                          "the coordinator this one took over from after its last replicated state, is the rank now",
                          rank=r.rank)
        if r is None or msg.get("incarnation") != r.incarnation or not r.alive():
            if r is not None and msg.type == MsgType.SAVED and self._sent_before_death(r, identity, msg):
                self.job.ttp.on_saved(msg)  # a shard file it wrote before it died is whole all the same
                return
            self.job.control.reject(identity, f"{msg.type.value} for a rank/incarnation that is not live here")
            return
        if msg.type == MsgType.HELLO:
            self.on_hello(identity, r, msg)
            return
        if identity != r.proc.identity:
            self.job.control.reject(identity, f"{msg.type.value} for rank {r.rank} from a connection that did not say hello")
            return
        r.proc.last_heartbeat = self.job.clock()
        r.proc.direct += 1
        handler = self._rank_handlers.get(msg.type)
        if handler is not None:
            handler(self, r, msg)

    @staticmethod
    def _sent_before_death(r: Rank, identity: bytes, msg: Message) -> bool:
        """Whether ``msg`` comes from a dead incarnation of ``r`` (the current one, not running, or
        the one before), on the connection that incarnation said hello on: a report it sent
        before its death, read after it (CI31: the shards of four periodic checkpoints were
        refused so, and those checkpoints never completed)."""
        for inc in (r.proc, r.previous):
            if inc is not None and not inc.running and inc.number == msg.get("incarnation"):
                return inc.identity is not None and inc.identity == identity
        return False

    def _adopts(self, r: Rank, msg: Message) -> bool:
        """A rank's hello after a takeover (``rejoin``) from a newer incarnation than this
        coordinator's state names, on a node not lost here: adopt it (:meth:`handle`)."""
        incarnation = msg.get("incarnation")
        return (self.job.epoch > 0 and bool(msg.get("rejoin")) and isinstance(incarnation, int)
                and not isinstance(incarnation, bool) and incarnation > r.incarnation
                and r.node not in self.job.members.lost_nodes and r.proc.identity is None)

    def on_hello(self, identity: bytes, r: Rank, msg: Message) -> None:
        """A rank's process connects: bind the rank to this connection; during a recovery its
        hello is its report (it holds no state) or it is told the recovery's generation."""
        p = r.proc
        if p.pid is None:
            p.pid = msg["pid"]  # its node's agent has not reported the spawn yet
        elif msg["pid"] != p.pid:
            self.job.control.reject(identity, f"hello for rank {r.rank} from pid {msg['pid']}, expected {p.pid}")
            return
        p.identity = identity
        r.library = bool(msg["library"])
        group = tuple(map(int, msg["replica_group"]))
        r.replica_group = self._replica_groups.setdefault(group, group)  # one object per group: cheap plans
        p.last_heartbeat = self.job.clock()
        p.direct += 1
        p.move(RankState.HEALTHY if self.job.rounds.current is None else RankState.RECOVERING)
        self.job.emit(EventKind.RANK_JOINED, f"rank {r.rank} connected (pid {p.pid})", rank=r.rank, library=r.library,
                      **({"rejoined": True} if msg.get("rejoin") else {}))
        self.job.failover.announce(r)
        hot = msg.get("hot")
        if isinstance(hot, str) and not msg.get("rejoin") and hot != "the training loop":
            # A hot spare promoted while its script waited for its rank in its set-up: correct, but
            # only as fast as a warm spare (docs/hot_spares.md).
            self.job.emit(EventKind.WARNING,
                      f"rank {r.rank}: its hot spare was still in the script's set-up, waiting on {hot[:80]} (the "
                      "script reads its rank before its training loop); it finished the set-up after its promotion, "
                      "as a warm spare does (docs/hot_spares.md)", rank=r.rank, fault="hot_spare_contract")
        if self.job.rounds.current is not None:
            seen = msg.get("seen") if msg.get("rejoin") else None
            self.job.rounds.on_hello(r, msg["generation"], seen if isinstance(seen, int) else None)

    def on_heartbeat(self, r: Rank, msg: Message) -> None:
        """A rank's heartbeat: its heartbeat thread's evidence and its step board (where its
        training thread is: :class:`ftrun.rank.client.StepBoard`)."""
        self._take_beat(r, msg.fields, self.job.clock())

    def _take_beat(self, r: Rank, fields: dict[str, Any], at: float) -> None:
        """What a heartbeat made at ``at`` (the coordinator's clock) says."""
        r.on_heartbeat(fields.get("in_dist"), fields.get("stage"), fields.get("stage_bytes"), at)
        if "phase" in fields:
            moved, sample = r.on_board(fields, at, self.job.spec.warmup_steps)
            self.job.watchdog.observe(sample)
            if moved:
                self.job.publisher.dirty = True

    def on_relayed(self, node: int, rows: list[Any]) -> None:
        """Node ``node``'s agent relayed its ranks' heartbeats (:mod:`ftrun.node.relay`; its frame
        was checked: it is that node's agent). A row counts only for a live rank of that node, in
        its current incarnation, that said hello. The beat proves the rank alive ``age`` seconds
        ago; its step board is taken unless a frame the rank sent the coordinator after it was read
        already (``sent`` below :attr:`Incarnation.direct`: the board is older than, say, its
        ``fault``, and would put back the phase the ``fault`` ended). Malformed rows are skipped."""
        now, ranks = self.job.clock(), self.job.ranks
        for row in rows:  # a row a rank a second: the checks are written for speed (docs/scale.md)
            if type(row) is not list or len(row) != 5:
                continue
            rank, incarnation, age, sent, board = row
            r = ranks.get(rank) if type(rank) is int else None
            if r is None:
                continue
            p = r.proc
            # an age above an hour is no evidence of life
            if (r.node != node or incarnation != p.number or not p.running or p.identity is None
                    or not is_seconds(age) or age > 3600 or type(board) is not dict):
                continue
            at = now - age
            if at > p.last_heartbeat:
                p.last_heartbeat = at
            p.relayed = True
            if type(sent) is int and sent >= p.direct:
                self._take_beat(r, board, at)

    def on_relayed_answers(self, node: int, rows: list[Any]) -> None:
        """Node ``node``'s agent relayed its ranks' answers to a round's orders (``fault``,
        ``recovered``; :mod:`ftrun.node.relay`), in the order it read them. Each is checked as a
        frame's message is (:func:`ftrun.common.protocol.relayed_message`) and taken only for a
        live rank of that node, in its current incarnation, that said hello; malformed rows and
        others are skipped. An answer proves the rank alive; it is not one of the frames the rank
        sent the coordinator itself (:attr:`Incarnation.direct`)."""
        now, ranks = self.job.clock(), self.job.ranks
        run: list[tuple[Rank, Message]] = []  # answers of one type in a row: handled together
        for row in rows:  # a row a rank, twice a round: written for speed (docs/scale.md)
            if type(row) is not list or len(row) != 2:
                continue
            try:
                msg = relayed_message(row[0], row[1], RELAYED_ANSWERS)
            except ProtocolError:
                continue
            r = ranks.get(msg.fields["rank"])
            if r is None or r.node != node:
                continue
            p = r.proc
            if msg.fields["incarnation"] != p.number or not p.running or p.identity is None:
                continue
            p.last_heartbeat = now
            if run and run[0][1].type is not msg.type:
                self._relayed_run(run)
                run = []
            run.append((r, msg))
        if run:
            self._relayed_run(run)

    def _relayed_run(self, run: list[tuple[Rank, Message]]) -> None:
        if run[0][1].type is MsgType.RECOVERED:
            self.job.rounds.on_recovered_ranks(run)
        else:
            self.on_faults(run)

    def on_progress(self, r: Rank, msg: Message) -> None:
        """``progress`` (``ft.report()``, a section opened or closed): the rank's step and metrics."""
        now = self.job.clock()
        r.on_progress(msg["step"], msg["metrics"], now)
        if "section" in msg.fields:
            r.on_section(msg.get("section"), msg.get("section_timeout"), now)
        self.job.publisher.dirty = True

    def on_fault_message(self, r: Rank, msg: Message) -> None:
        """A failed collective, a recoverable error, or the answer to an abort (a dying gasp's
        report while one runs)."""
        r.proc.committed = msg.fields["committed"]
        r.proc.phase = RankPhase.RECOVERING
        gasp = self.job.ttp.gasp
        if gasp is not None:
            if msg["generation"] == gasp.generation:
                gasp.reports[r.rank] = msg["committed"]
            return
        self.job.rounds.on_fault(r, msg)

    def on_faults(self, faults: list[tuple[Rank, Message]]) -> None:
        """``fault`` messages, in the order read (a node's relayed answers): those that lead them
        and answer the round's abort before its plan are taken together (every rank's, every
        round: :meth:`ftrun.coordinator.rounds.RecoveryRounds.on_abort_answers`), the others one by
        one (:meth:`on_fault_message`)."""
        lead = self.job.rounds.abort_answers(faults) if self.job.ttp.gasp is None else 0
        for r, msg in faults[:lead]:
            p = r.proc
            p.committed, p.phase = msg.fields["committed"], RankPhase.RECOVERING
        if lead:
            self.job.rounds.on_abort_answers(faults[:lead])
        for r, msg in faults[lead:]:
            self.on_fault_message(r, msg)

    def on_error(self, r: Rank, msg: Message) -> None:
        """A rank reports a problem it survived (e.g. a shard it could not write)."""
        step = msg.fields.get("checkpoint")
        if isinstance(step, int) and not isinstance(step, bool):
            self.job.ttp.on_periodic_failure(r.rank, step, msg["reason"])
            return
        self.job.emit(EventKind.WARNING, f"rank {r.rank} reported: {msg['reason']}", rank=r.rank)
        self.job.ttp.on_writer_error(r.rank, msg["reason"])

    def on_done(self, r: Rank, msg: Message) -> None:
        """A rank says it called ``ft.finish()``: a claim, never the job's end.

        The job ends when every rank's *process* has exited (code after ``finish()`` -- saving the
        model, writing metrics -- runs, as under torchrun). The claim is checked: ranks that
        finished at different committed steps are named in a warning (a diverged job).
        """
        p = r.proc
        p.steps_ended, p.phase, p.finished = True, RankPhase.DONE, True
        committed = msg.get("committed")
        if isinstance(committed, int) and not isinstance(committed, bool):
            p.final_step = committed
            claims = {x.rank: x.proc.final_step for x in self.job.ranks.values() if x.proc.final_step is not None}
            if len(set(claims.values())) > 1:
                self.job.emit(EventKind.WARNING, f"ranks finished at different committed steps: {claims}", claims=claims)
        self.release_finish_barrier()

    def release_finish_barrier(self) -> None:
        """Once every rank has finished (said ``done``, or exited 0), let the ranks waiting in
        ``ft.finish()`` go. Until then they keep their final state for a rank that dies in its
        epilogue (it is respawned and recovers from them like any other)."""
        if self.job.rounds.current is not None or not all(x.proc.finished or x.proc.state == RankState.SUCCEEDED
                                                      for x in self.job.ranks.values()):
            return
        for x in self.job.ranks.values():
            if x.proc.finished and x.alive() and x.proc.identity is not None and not x.proc.released:
                x.proc.released = True
                self.job.send(x, MsgType.FINISHED)

    def on_divergence(self, r: Rank, msg: Message) -> None:
        """A rank found that exactly-once does not hold: a step it recomputed gave
        another local gradient than the first computation (state the script carries outside what
        ftrun restores), or replicas hold other parameters after a recovery. A ``divergence``
        event and a console warning; with ``--on_divergence fail`` the job stops with a
        dying-gasp checkpoint of the last step every rank committed (the rank holds its
        diverged step back until the abort)."""
        step, check = msg["step"], msg["check"]
        fail = self.job.spec.on_divergence == "fail"
        self.job.emit(EventKind.DIVERGENCE, f"rank {r.rank} diverged at step {step} ({check}): {msg['reason'][:600]}"
                  + ("; stopping (--on_divergence fail)" if fail else ""), rank=r.rank, step=step, check=check,
                  reason=msg["reason"][:1000])
        if fail and self.job.exit_code is None and self.job.phase.current in (JobPhase.RUNNING, JobPhase.RECOVERING):
            self.job.finish_with(self.job.stop(DIVERGENCE_EXIT_CODE, f"stopped: rank {r.rank} diverged at step {step} "
                                       "(--on_divergence fail)"))

    _rank_handlers: dict[MsgType, Callable[["RankMessages", Rank, Message], None]] = {
        MsgType.HEARTBEAT: on_heartbeat,
        MsgType.PROGRESS: on_progress,
        MsgType.STEPS_END: lambda self, r, msg: r.on_steps_end(),
        MsgType.FAULT: on_fault_message,
        MsgType.SAVED: lambda self, r, msg: self.job.ttp.on_saved(msg),
        MsgType.RECOVERED: lambda self, r, msg: self.job.rounds.on_recovered(r, msg),
        MsgType.DONE: on_done,
        MsgType.ERROR: on_error,
        MsgType.DIVERGENCE: on_divergence,
    }

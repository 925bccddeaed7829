"""The watchdog: pure verdicts on the rank table and a clock passed in (no sockets, no processes).

NVIDIA resiliency-ext's timeout calculator is the model: hang bounds come from observed step
times (the largest after warm-up, times a safety factor) and from configured bounds, and the code
that decides is separate from the code that acts. :meth:`Watchdog.inspect` returns what it found
(:class:`Hung` ranks, a :class:`CommHang`, or an :class:`Unrepaired` fault whose grace ran out);
the coordinator acts on it (dump the stacks and kill, rebuild the group, restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

from ftrun.coordinator.ranks import Rank, RankPhase, RecoveryRound

REPORT_DEADLINE_S = 10.0  # a survivor answers an abort in milliseconds; after this it is hung
PLAN_DEADLINE_S = 60.0  # to build the new group and move the state, unless waiting in torch.distributed
UNREPAIRED_GRACE_S = 1.0  # wait this long for a death to explain a failed collective before restarting
STALL_BASE_S = 5.0  # a rank outside torch.distributed this long during a watched stage, peers waiting, is hung
STALL_MIN_BYTES_PER_S = 50e6  # ...plus the stage's bytes at this rate (copying state runs at GB/s)
STALL_STAGES = {"recover": "the recovery's drop of its group", "transfer": "the state transfer",
                "init": "the initial broadcast"}  # watched stages (ftrun.rank.recovery.RankProgress.stage)


@dataclass(frozen=True)
class WatchdogBounds:
    """The configured bounds, seconds (``--heartbeat_timeout``, ``--setup_timeout``...)."""

    heartbeat_timeout: float
    heartbeat_interval: float
    setup_timeout: float
    step_timeout: float  # 0: automatic
    step_timeout_min: float
    step_timeout_factor: float
    warmup_steps: int


@dataclass(frozen=True)
class Hung:
    """A rank found hung: ``kind`` (no_heartbeat, section, stalled, setup, recovery, no_progress),
    the evidence in words, and since when (the coordinator's clock)."""

    rank: int
    kind: str
    evidence: str
    since: float


@dataclass(frozen=True)
class CommHang:
    """Every rank waits in the same collective and none progresses: the group itself is stuck."""

    reason: str


@dataclass(frozen=True)
class Unrepaired:
    """A fault was reported that no switch repairs, and no death explained it within the grace."""

    reason: str


Finding = Sequence[Hung] | CommHang | Unrepaired | None


@dataclass
class Candidates:
    """What one walk over the rank table found for the watchdog's checks (:meth:`Watchdog.candidates`):
    ranks whose heartbeats are older than the timeout, in a section, awaited after a takeover,
    outside torch.distributed in a stage the stall check bounds, without a step; the newest step
    progress of a rank that steps (None: none steps); whether a kill is pending."""

    late: list[Rank]
    in_section: list[Rank]
    rejoining: list[Rank]
    outside: list[Rank]
    no_step: list[Rank]
    newest: float | None = None
    kill_pending: bool = False


class Watchdog:
    """Hang verdicts for one job (NVRx's and torchrun's idea of a rank alive but not progressing).

    Args:
        bounds: the configured bounds.

    State: the largest step time seen after warm-up (the automatic step timeout's base) and a
    reported fault that no switch repairs, waiting :data:`UNREPAIRED_GRACE_S` for a death.
    """

    def __init__(self, bounds: WatchdogBounds) -> None:
        self.bounds = bounds
        self.max_step_time: float | None = None  # largest step time seen after warm-up (seconds)
        self.unrepaired: tuple[float, str] | None = None  # (since, why) of a fault no switch repairs

    def observe(self, sample: float | None) -> None:
        """A step time (seconds) past warm-up, from :meth:`Rank.on_board`."""
        if sample is not None:
            self.max_step_time = max(self.max_step_time or 0.0, sample)

    def note_unrepaired(self, now: float, reason: str) -> None:
        if self.unrepaired is None:
            self.unrepaired = (now, reason)

    def step_timeout(self) -> float:
        """Seconds without progress after which the job is hung: ``--step_timeout``, else
        max(step_timeout_min, largest step after warm-up x step_timeout_factor), else (still
        warming up) ``--setup_timeout``."""
        b = self.bounds
        if b.step_timeout > 0:
            return b.step_timeout
        if self.max_step_time is None:
            return b.setup_timeout
        return max(b.step_timeout_min, self.max_step_time * b.step_timeout_factor)

    def stall_bound(self, r: Rank) -> float:
        """Seconds a rank may spend in its own code during a stage that its peers wait on (a
        recovery's drop and transfer, the initial broadcast): a few heartbeats, plus the time to
        copy the bytes that stage moves at a rate far below memory speed."""
        return max(STALL_BASE_S, 3 * self.bounds.heartbeat_interval) + r.proc.stage_bytes / STALL_MIN_BYTES_PER_S

    def inspect(self, ranks: Iterable[Rank], recovery: RecoveryRound | None, failures_in_round: bool,
                nodes_joined: Collection[int], now: float, quiet_nodes: Collection[int] = ()) -> Finding:
        """What the watchdog finds now, in order: an unrepaired fault past its grace; a rank without
        heartbeats; a section past its bound; a stall inside a recovery or the initial broadcast;
        an overdue set-up; a recovery round past its deadlines; no step progress. The first kind
        found is returned (every rank of that kind).

        Args:
            ranks: the rank table.
            recovery: the recovery round in progress, if any.
            failures_in_round: a rank failed since the last recovery ended (a death explains a
                failed collective).
            nodes_joined: the nodes whose agents are connected (ranks elsewhere are not started).
            now: the coordinator's clock, seconds.
            quiet_nodes: the nodes whose agents have gone quiet (a node that may be lost): no step
                progress is then blamed on any rank (:meth:`progress`).
        """
        ranks = list(ranks)
        if self.unrepaired is not None and (recovery is not None or failures_in_round):
            self.unrepaired = None  # a death explains it; ARF or the restart policy handles that
        if self.unrepaired is not None and now - self.unrepaired[0] > UNREPAIRED_GRACE_S:
            reason, self.unrepaired = self.unrepaired[1], None
            return Unrepaired(reason)
        c = self.candidates(ranks, now)
        for find, candidates in ((self.heartbeats, c.late), (self.sections, c.in_section), (self.rejoins, c.rejoining)):
            found = find(candidates, now)
            if found:
                return found[:1]
        for look in (lambda: self.stalls(ranks, now, c.outside), lambda: self.setup(ranks, recovery, nodes_joined, now, c.no_step),
                     lambda: self.round_deadline(ranks, recovery, now)):
            found = look()  # in order, and no further than the first kind found
            if found:
                return found
        if recovery is not None or c.kill_pending:
            return None  # recovering ranks wait for each other (set-up and heartbeats still apply); or a kill is pending
        if quiet_nodes:
            # A node whose agent went quiet is the likelier cause of a stalled step: its ranks'
            # collectives cut short can leave a live rank elsewhere a step behind its peers, which
            # is no hang of its own. The node's loss is found within the silence timeout (or it is
            # heard again), so the wait is bounded (CI30: a rank of node 0 was killed so).
            return None
        if c.newest is None or now - c.newest <= self.step_timeout():
            return None  # the usual case: some rank stepped within the step timeout
        return self.progress(ranks, now)

    def candidates(self, ranks: Sequence[Rank], now: float) -> "Candidates":
        """One walk over the rank table picks each check's candidates by its rarest condition; the
        checks then look at those alone (and at every rank only once one has a candidate). At
        16,384 ranks, a walk per check was a sixth of the coordinator's busy time (docs/scale.md)."""
        since = now - self.bounds.heartbeat_timeout
        c = Candidates([], [], [], [], [])
        for r in ranks:
            p = r.proc
            if p.last_heartbeat < since:
                c.late.append(r)
            if p.section is not None:
                c.in_section.append(r)
            if p.rejoin_by is not None:
                c.rejoining.append(r)
            if p.outside_since is not None and p.stage in STALL_STAGES:
                c.outside.append(r)
            if p.step is None:
                c.no_step.append(r)
            elif p.running and r.library and not p.steps_ended and (c.newest is None or p.last_progress > c.newest):
                c.newest = p.last_progress
            if p.kill_reason is not None and p.running:
                c.kill_pending = True
        return c

    def heartbeats(self, ranks: Sequence[Rank], now: float) -> list[Hung]:
        """Ranks whose heartbeats stopped for ``--heartbeat_timeout`` (after ft.finish() a rank
        sends nothing: its own code runs to its exit)."""
        timeout = self.bounds.heartbeat_timeout
        since = now - timeout  # one comparison a rank first: a pass looks at every rank (docs/scale.md)
        return [Hung(r.rank, "no_heartbeat", f"no heartbeat for {now - r.proc.last_heartbeat:.1f} s "
                                             f"(--heartbeat_timeout {timeout:g})", r.proc.last_heartbeat)
                for r in ranks if r.proc.last_heartbeat < since and r.connected() and not r.proc.finished]

    @staticmethod
    def rejoins(ranks: Sequence[Rank], now: float) -> list[Hung]:
        """After a takeover, running ranks that have not said hello to this coordinator by their
        ``rejoin_by`` (two silence timeouts: every live rank moves within one): their channel is
        stuck on a dead coordinator (none told it where to go), so they are killed and respawned
        rather than waited for by every round."""
        return [Hung(r.rank, "no_heartbeat", f"did not say hello to this coordinator within "
                                             f"{r.proc.rejoin_by - r.proc.started_at:.0f} s of its takeover", r.proc.started_at)
                for r in ranks if r.proc.rejoin_by is not None and now > r.proc.rejoin_by and r.alive()
                and r.proc.identity is None and r.proc.kill_reason is None]

    @staticmethod
    def sections(ranks: Sequence[Rank], now: float) -> list[Hung]:
        """Ranks in a named section past that section's own bound."""
        out = []
        for r in ranks:
            p = r.proc
            if (p.section is not None and p.section_timeout is not None and p.running and p.kill_reason is None
                    and now - p.section_started > p.section_timeout):
                out.append(Hung(r.rank, "section", f"in section {p.section!r} for {now - p.section_started:.1f} s "
                                                   f"(its timeout {p.section_timeout:g} s)", p.section_started))
        return out

    def stalls(self, ranks: Sequence[Rank], now: float, outside: Sequence[Rank] | None = None) -> list[Hung]:
        """A rank stuck in its own code during a recovery's drop or transfer, or before the initial
        broadcast, while a peer waits for it inside torch.distributed (the peers say so: their
        heartbeats see them there), is hung after :meth:`stall_bound` seconds, whatever the
        round's or the set-up's longer deadlines (round 3: a hang at ``rejoin`` held the job until
        the 300 s set-up timeout, at ``transfer`` for 60-150 s)."""
        stalled_ranks = [r for r in (ranks if outside is None else outside)  # outside: those outside in such a stage
                         if r.proc.outside_since is not None and r.proc.stage in STALL_STAGES
                         and r.connected() and not r.proc.finished]
        if not stalled_ranks:
            return []  # the usual case: no rank outside torch.distributed in such a stage, no look at the others
        waiting = [r.rank for r in ranks if r.proc.in_dist is True and r.connected() and not r.proc.finished]
        out = []
        for r in stalled_ranks:
            p = r.proc
            stalled, bound = now - p.outside_since, self.stall_bound(r)
            others = [w for w in waiting if w != r.rank]
            if stalled > bound and others:
                out.append(Hung(r.rank, "stalled", f"rank {r.rank} stuck in its own code for {stalled:.1f} s during "
                                                   f"{STALL_STAGES[p.stage]} (bound {bound:.1f} s) while rank(s) {others} "
                                                   "wait for it in torch.distributed", p.outside_since))
        return out

    def setup(self, ranks: Sequence[Rank], recovery: RecoveryRound | None, nodes_joined: Collection[int], now: float,
              no_step: Sequence[Rank] | None = None) -> list[Hung]:
        """Ranks that have not begun a step ``--setup_timeout`` seconds after their start. Only
        those not waiting in a torch.distributed call (the initial broadcast, a rendezvous) are
        hung: the others wait for them."""
        timeout = self.bounds.setup_timeout
        if recovery is not None and now - recovery.round_started < REPORT_DEADLINE_S:
            return []  # ranks released by the abort (a failed broadcast) get the time to report
        overdue = [r for r in (ranks if no_step is None else no_step) if r.proc.step is None and r.alive() and r.proc.kill_reason is None and not r.proc.finished
                   and r.library and not r.proc.steps_ended and now - r.proc.started_at > timeout
                   and r.proc.phase == RankPhase.SETUP  # one that reported a fault is in a recovery round: its deadlines apply
                   and r.node in nodes_joined]  # a rank whose node has not (re)joined is not started yet
        if not overdue:
            return []
        culprits = [r for r in overdue if r.proc.in_dist is not True]
        if not culprits:
            waiting = [r for r in ranks if r.alive() and r.proc.in_dist is True]
            if len(waiting) < len([r for r in ranks if r.alive()]):
                return []  # someone not yet overdue is what they wait for: its own timeout comes
            culprits = overdue  # every rank waits in a collective: nobody else can be blamed
        return [Hung(r.rank, "setup", f"no step begun {now - r.proc.started_at:.0f} s after start (--setup_timeout "
                                      f"{timeout:g})" + ("" if r.proc.in_dist is None else "; not waiting for its peers"),
                     r.proc.started_at) for r in culprits]

    @staticmethod
    def round_deadline(ranks: Sequence[Rank], rec: RecoveryRound | None, now: float) -> list[Hung]:
        """Every recovery round has a deadline: a connected rank that has not answered the abort
        within :data:`REPORT_DEADLINE_S`, or has not carried out the plan within
        :data:`PLAN_DEADLINE_S` while not waiting in torch.distributed, is hung and replaced,
        never waited for (a rank stuck in its own code inside a collective, or during a transfer)."""
        if rec is None:
            return []
        # A rank still in its set-up (a respawned one, connected but not yet at its loop) reads no
        # message before its loop: --setup_timeout bounds it, not these deadlines.
        live = [r for r in ranks if r.connected() and r.proc.phase != RankPhase.SETUP]
        if rec.plan is None:
            if now - rec.round_started <= REPORT_DEADLINE_S:
                return []
            # A rank blocked in torch.distributed is released by the abort (its connections cut)
            # and answers; it gets the plan's longer bound before it is taken for hung.
            waited = now - rec.round_started
            late = [r for r in live if r.rank not in rec.reports and (r.proc.in_dist is not True or waited > PLAN_DEADLINE_S)]
            what, since = f"did not answer the abort of generation {rec.generation} within {waited:.0f} s", rec.round_started
        else:
            if now - rec.planned_at <= PLAN_DEADLINE_S:
                return []
            late = [r for r in live if r.rank not in rec.recovered and r.proc.in_dist is not True]
            what, since = f"did not carry out the plan of generation {rec.generation} within {PLAN_DEADLINE_S:g} s", rec.planned_at
        return [Hung(r.rank, "recovery", f"rank {r.rank} {what}", since) for r in late]

    def progress(self, ranks: Sequence[Rank], now: float) -> Finding:
        """No step progress for :meth:`step_timeout` seconds. The culprit is the rank not waiting
        for its peers: one that never announced the collective, or one whose heartbeat thread sees
        it outside torch.distributed although it announced it (stuck in its own code between the
        announcement and the call). With none, every rank waits in the collective: a
        :class:`CommHang`."""
        live = [r for r in ranks if r.proc.running and r.library and r.proc.step is not None and not r.proc.steps_ended]
        if not live:
            return None
        timeout = self.step_timeout()
        last = max([r.proc.last_progress for r in live])
        if now - last <= timeout:
            return None
        stalled = f"no step progress for {now - last:.1f} s (step timeout {timeout:.1f} s)"
        # What a rank's heartbeats last said is trusted only while they still come: a rank whose
        # heartbeat thread went quiet (a process stuck holding the GIL, one dying) may have moved on
        # since, and one whose board shows an earlier step than another's cannot wait in the same
        # collective (the step board lags by at most a heartbeat interval, far below the step timeout).
        newest = max(r.proc.step or 0 for r in live)
        quiet = 2.5 * self.bounds.heartbeat_interval
        culprits = [r for r in live if r.proc.phase != RankPhase.COLLECTIVE or r.proc.in_dist is False
                    or (r.proc.step or 0) < newest or now - r.proc.last_heartbeat > quiet]
        silent = [r for r in culprits if now - r.proc.last_heartbeat > quiet]
        if silent:
            # A rank gone quiet (frozen, or dying) explains its peers' stall, and one a step behind
            # may only be waiting for it (a collective it cut short): the quiet ones are blamed.
            culprits = silent
        if not culprits:
            return CommHang(f"{stalled}; every rank waits in the collective of step {max(r.proc.step or 0 for r in live)}")
        out = []
        for r in culprits:
            where = (f"(its heartbeats stopped {now - r.proc.last_heartbeat:.1f} s ago)" if now - r.proc.last_heartbeat > quiet
                     else f"(behind its peers' step {newest})" if (r.proc.step or 0) < newest
                     else "outside the collective it announced" if r.proc.phase == RankPhase.COLLECTIVE
                     else f"({r.proc.phase.value})")
            waiting = [x.rank for x in live if x is not r and x.proc.in_dist is True]
            peers = (f"while rank(s) {waiting} wait in torch.distributed" if waiting
                     else "while its peers wait for it" if len(culprits) < len(live) else "like every rank")
            out.append(Hung(r.rank, "no_progress", f"{stalled}; rank {r.rank} stuck at step {r.proc.step} {where} {peers}", last))
        return out

"""Pure recovery decisions: events and state in, a plan out. No processes, sockets or clocks.

The supervisor feeds this module what it observed (which ranks failed, which ranks use the worker
library, the restart budget, the committed step each live rank reports) and acts on what comes back.
Keeping the policy pure is what lets its tests run with no processes at all (the weak spot of
torch.distributed.elastic's agent, whose restart policy is fused into its run loop).

Terms: a *replica group* is a set of ranks holding identical training state (pure data parallel: all
ranks; DP x TP: the ranks with the same TP coordinate). A rank's *committed step* is the last step
whose optimizer update finished on it (MindIO TTP's "Updated" state). Two values below 0 mark the
time before the first update: :data:`INITIAL` (-1) is the synchronised initial state (the model as
rank 0 broadcast it, no step applied), :data:`NO_STATE` (-2) is no usable state at all (a new
process, a rank whose initial broadcast broke off, or a transfer into it that broke off).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Mapping, Sequence

from ftrun.common.contract import INITIAL, NO_STATE  # noqa: F401 (the committed-step sentinels, re-exported)


class RankState(str, Enum):
    """Life cycle of one rank, as the supervisor sees it (cf. torchelastic's WorkerState)."""

    STARTING = "starting"  # process spawned, no hello yet
    HEALTHY = "healthy"  # said hello, training
    RECOVERING = "recovering"  # in a reconfiguration (survivor, donor or recipient)
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero or by a signal
    STOPPED = "stopped"  # stopped by ftrun


#: The moves of one incarnation's :class:`RankState` (its process's life; a respawn starts a fresh
#: incarnation at STARTING). An exit is final; a rank being stopped may still exit on its own.
RANK_TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    RankState.STARTING: frozenset(RankState) - {RankState.STARTING},
    RankState.HEALTHY: frozenset(RankState) - {RankState.STARTING},
    RankState.RECOVERING: frozenset(RankState) - {RankState.STARTING},
    RankState.STOPPED: frozenset({RankState.STOPPED, RankState.SUCCEEDED, RankState.FAILED}),
    RankState.SUCCEEDED: frozenset({RankState.SUCCEEDED}),
    RankState.FAILED: frozenset({RankState.FAILED}),
}


class Action(str, Enum):
    """What the coordinator does about a failure."""

    RESPAWN_RANKS = "respawn_ranks"  # ARF: replace only the failed ranks
    RESTART_JOB = "restart_job"  # torchrun semantics: stop all, start all
    FAIL_JOB = "fail_job"  # budget exhausted: stop all, exit with the root cause's code
    RECORD = "record"  # only record the failure: --join lets the others finish, or the job is restarting or ending
    MOVE_HOME = "move_home"  # ranks stopped to move back to their node, which joined: respawned there, no restart spent
    HOLD = "hold"  # failures before ftrun.init: held while the other ranks end alike or say hello (StartupFailures)


@dataclass(frozen=True)
class Decision:
    """The policy's answer to a failure: an action, the ranks it concerns and why (one line).
    ``counts_restart``: a whole-job restart spends one restart (not when it is the checkpoint's
    fault: :func:`decide_restart`)."""

    action: Action
    ranks: tuple[int, ...]
    reason: str
    counts_restart: bool = True


# A rank that ends with one of these after every other rank exited 0 crashed in its teardown (an
# abort or a segfault in a destructor): the job is not restarted for it (:func:`decide_failed_ranks`).
TEARDOWN_CRASH_CODES = frozenset({128 + signal.SIGABRT, 128 + signal.SIGSEGV})


@dataclass(frozen=True)
class FailedRank:
    """What the coordinator knows of one failed rank when it decides.

    Attributes:
        rank: the global rank.
        exit_code: its exit code (128+N for signal N), or None when unknown.
        exit_desc: its exit in words (``exit code 1``, ``killed by SIGSEGV``...).
        library: its process said hello through the worker library.
        finished: it had called ``ftrun.finish()`` (said done).
        started_up: past its start-up (said hello, or ran past
            :data:`STARTUP_WINDOW_S`): a failure then is no start-up failure.
    """

    rank: int
    exit_code: int | None = 1
    exit_desc: str | None = None
    library: bool = True
    finished: bool = False
    started_up: bool = True


@dataclass(frozen=True)
class FailureFacts:
    """Everything a failure decision depends on, gathered by the coordinator (no process needed).

    Attributes:
        failed: the ranks that failed, in the order they were found.
        world_size, arf, max_restarts: the job's (``--worker_num``, the ARF switch, the budget).
        library_ranks: ranks whose current process said hello through the worker library.
        restarts_used: restarts already spent.
        one_event: the ranks were lost together (a node's loss): respawning them costs one restart.
        join: ``--join``: the other ranks finish, nothing is restarted.
        active: the job is running or recovering (otherwise it is restarting or ending already).
        moving_home: every failed rank was stopped to move back to its node, which joined again.
        unusable_checkpoint: the checkpoint this attempt started from does not load.
        others_succeeded: there are other ranks and every one of them exited 0.
        others_started_up: some rank that did not fail is past its start-up.
        startup_held: failures before ``ftrun.init`` are being held (:class:`StartupFailures`).
    """

    failed: tuple[FailedRank, ...]
    world_size: int
    arf: bool
    library_ranks: tuple[int, ...]
    restarts_used: int
    max_restarts: int
    one_event: bool = False
    join: bool = False
    active: bool = True
    moving_home: bool = False
    unusable_checkpoint: bool = False
    others_succeeded: bool = False
    others_started_up: bool = False
    startup_held: bool = False

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failed]

    def early_exits(self) -> dict[int, int]:
        """rank -> exit code of the failed ranks that had not started up (start-up failures)."""
        return {f.rank: f.exit_code or 0 for f in self.failed if not f.started_up}

    def hello(self) -> bool:
        """Some rank of the attempt is past its start-up (a failed one, or another)."""
        return len(self.early_exits()) < len(self.failed) or self.others_started_up


def decide_failure(facts: FailureFacts) -> Decision:
    """The first answer to ranks that failed, rule by rule:

    1. with ``--join``, or while the job is restarting or ending, the failure is only recorded;
    2. ranks stopped to move back to their node (an elastic job whose node joined again) are
       respawned there, no restart spent;
    3. when the attempt's checkpoint does not load, the job restarts from an older one;
    4. failures before ``ftrun.init`` are held (:class:`StartupFailures`: does every rank fail
       alike?), with the ranks to hold (``ranks``) and :meth:`FailureFacts.hello`;
    5. else :func:`decide_failed_ranks`.
    """
    ranks = tuple(facts.ranks)
    if facts.join or not facts.active:
        why = "--join: the other ranks finish" if facts.join else "the job is restarting or ending"
        return Decision(Action.RECORD, ranks, why)
    if facts.moving_home:
        return Decision(Action.MOVE_HOME, ranks, f"rank(s) {sorted(ranks)} move back to their node")
    if facts.unusable_checkpoint:
        return Decision(Action.RESTART_JOB, ranks, f"rank(s) {sorted(ranks)} failed")
    early = facts.early_exits()
    if early or facts.startup_held:
        return Decision(Action.HOLD, tuple(early), "failed before ftrun.init: held to see whether every rank fails alike")
    return decide_failed_ranks(facts)


def decide_failed_ranks(facts: FailureFacts) -> Decision:
    """Ranks that failed after every other rank exited 0, each a plain script's rank or one that
    had said done, with a teardown crash's code (:data:`TEARDOWN_CRASH_CODES`): the job fails
    without a restart (:func:`teardown_crash`); else :func:`decide_on_failure`."""
    if facts.failed and facts.others_succeeded and all(
            (not f.library or f.finished) and f.exit_code in TEARDOWN_CRASH_CODES for f in facts.failed):
        return Decision(Action.FAIL_JOB, tuple(sorted(facts.ranks)), teardown_crash(facts.ranks, facts.failed[0].exit_desc))
    return decide_on_failure(facts.ranks, world_size=facts.world_size, arf=facts.arf, library_ranks=facts.library_ranks,
                             restarts_used=facts.restarts_used, max_restarts=facts.max_restarts, one_event=facts.one_event)


def teardown_crash(failed: Sequence[int], desc: str | None) -> str:
    """Why ranks that crashed after every other rank finished (exit 0) are not restarted: a plain
    script's rank crashing in its teardown (seen with Hugging Face Trainer: SIGABRT at exit), or a
    library rank that had said done (no peer is left to recover it from). The job's work is done;
    a restart would train it again."""
    return (f"rank(s) {sorted(failed)} crashed ({desc}) after every other rank had finished successfully (exit "
            "code 0): not restarted (a restart would run the whole script again); the training likely completed: "
            "check the rank's log for what failed at its end")


def decide_restart(reason: str, *, restarts_used: int, max_restarts: int, unusable: str | None = None) -> Decision:
    """A whole-job restart (torchrun semantics) asked for ``reason``: when the attempt's checkpoint
    does not load (``unusable``: which and why, in words), it is not the job's fault, so the
    restart spends nothing (the next attempt skips that checkpoint for the next older one); else
    it spends one restart, or the job fails past ``max_restarts``."""
    if unusable is not None:
        return Decision(Action.RESTART_JOB, (), f"{reason}; {unusable}", counts_restart=False)
    if not restart_fits(restarts_used, 1, max_restarts):
        return Decision(Action.FAIL_JOB, (), f"{reason}; restart budget exhausted (max_restarts={max_restarts})")
    return Decision(Action.RESTART_JOB, (), reason)


def restart_fits(restarts_used: int, cost: int, max_restarts: int) -> bool:
    """The restart budget (torchrun's and msrun's ``max_restarts``): ``cost`` more restarts (one
    per respawned rank, one for a whole-job restart) fit when the total stays within it."""
    return restarts_used + cost <= max_restarts


def respawn_restarts(failed: Sequence[int] | set[int], one_event: bool) -> int:
    """Restarts that respawning ``failed`` costs: one per rank, or one in all for ranks lost in one
    event (a node's loss)."""
    return min(1, len(failed)) if one_event else len(failed)


def decide_on_failure(
    failed: Iterable[int],
    *,
    world_size: int,
    arf: bool,
    library_ranks: Iterable[int],
    restarts_used: int,
    max_restarts: int,
    one_event: bool = False,
) -> Decision:
    """Decide what to do when ranks ``failed`` (exited non-zero, by a signal, or were killed).

    ARF (respawn only the failed ranks, on whatever node they run) is chosen when it is switched on
    and every rank of the job has announced the worker library (a plain torchrun-style script cannot
    rejoin a running group); each respawned rank uses one restart from the budget. Otherwise the
    whole job restarts on every node (one restart). When respawning each failed rank would need
    more restarts than the budget has left but one whole-job restart fits, the whole job restarts
    (from the newest checkpoint: the dying gasp keeps what the survivors hold). Past
    ``max_restarts`` the job fails. A node's loss is one event (``one_event``: its ranks went
    together, as in MindCluster's pod-level rescheduling): respawning all its ranks costs one
    restart, so a link that fails once spends one restart, not one per rank of the node.

    Args:
        failed: global ranks that failed (at least one).
        world_size: ranks in the job.
        arf: the ARF switch.
        library_ranks: ranks whose current process said hello through the worker library.
        restarts_used: restarts already spent (rank respawns plus whole-job restarts).
        max_restarts: the budget.
        one_event: the ranks failed together (a node's loss): respawning them costs one restart.

    Returns:
        The decision.
    """
    failed_ranks = tuple(sorted(set(failed)))
    if not failed_ranks:
        raise ValueError("decide_on_failure needs at least one failed rank")
    arf_possible = arf and set(library_ranks) >= set(range(world_size))
    respawn_cost = respawn_restarts(failed_ranks, one_event)
    if arf_possible and restart_fits(restarts_used, respawn_cost, max_restarts):
        return Decision(Action.RESPAWN_RANKS, failed_ranks, "ARF: respawn only the failed rank(s)")
    if not restart_fits(restarts_used, 1, max_restarts):
        cost = respawn_cost if arf_possible else 1
        return Decision(Action.FAIL_JOB, failed_ranks, f"restart budget exhausted: {restarts_used} of "
                        f"max_restarts={max_restarts} used, {cost} more needed")
    why = _why_whole_job(failed_ranks, world_size, arf, arf_possible, library_ranks, max_restarts - restarts_used)
    return Decision(Action.RESTART_JOB, failed_ranks, f"whole-job restart ({why})")


def _why_whole_job(failed: tuple[int, ...], world_size: int, arf: bool, arf_possible: bool,
                   library_ranks: Iterable[int], restarts_left: int) -> str:
    """Why :func:`decide_on_failure` restarts the whole job instead of respawning ``failed``."""
    if arf_possible:
        return (f"respawning {len(failed)} rank(s) would need more than the {restarts_left} restart(s) left; "
                "one whole-job restart fits")
    if not arf:
        return "ARF is off"
    missing = sorted(set(range(world_size)) - set(library_ranks))
    early = [r for r in missing if r in failed]
    return (f"rank(s) {rank_ranges(early)} exited before ftrun.init" if early == missing
            else f"rank(s) {rank_ranges(missing)} have not said hello through the ftrun worker library (still "
                 "starting, or the script does not use it)")


USAGE_EXIT_CODE = 2  # the Unix convention for a command-line usage error (argparse, click, getopt)
STARTUP_HOLD_S = 10.0  # a failure before ftrun.init waits this long for the other ranks to end alike
STARTUP_WINDOW_S = 120.0  # a rank that exits this soon after its start, without a hello, failed in its start-up


class StartupFailures:
    """Failures before ``ftrun.init``: is the script's start-up failing the same way everywhere?

    A script that exits in every rank with one exit code before it could say hello (argparse's usage
    error, a missing file, a broken import) fails the same way in every attempt: torchrun restarts
    it ``max_restarts`` times, spending the budget and minutes for nothing. So the first such failure
    of an attempt is held (at most ``hold`` seconds) while the attempt's other ranks either end the
    same way or say hello. Every rank ending with one code is a deterministic start-up failure when
    the code is :data:`USAGE_EXIT_CODE` or the previous attempt ended the same way: the job ends
    with that code. Anything else is decided as usual (:func:`decide_on_failure`).

    The coordinator calls :meth:`hold` with each failure of ranks that never said hello and
    :meth:`settle` at every turn of its loop while :attr:`held`; the clock is passed in, seconds.
    """

    def __init__(self, world_size: int, hold: float = STARTUP_HOLD_S) -> None:
        self.world_size, self.hold_s = world_size, hold
        self.exits: dict[int, int] = {}  # rank -> exit code, this attempt, before ftrun.init
        self.since: float | None = None  # when the first was held (None: nothing held)
        self.previous: int | None = None  # the code every rank ended with in the previous attempt

    @property
    def held(self) -> bool:
        return self.since is not None

    def hold(self, exits: Mapping[int, int], now: float, hello: bool) -> list[int] | None:
        """Ranks ended (``exits``: rank -> exit code) before saying hello; ``hello``: some rank of
        this attempt said hello (or failed after it). None: hold the decision (:meth:`settle` gives
        it later); else the ranks held so far, these included, to decide on now."""
        self.exits.update(exits)
        if not hello:
            if self.since is None:
                self.since = now
            return None
        self.since = None
        return sorted(self.exits)

    def settle(self, now: float, hello: bool, alive: int) -> tuple[list[int], str | None] | None:
        """The held decision once due: None while the other ranks (``alive`` of them, none having
        said hello) may still end alike within the hold; else (the held ranks, the reason to end
        the job or None to decide as usual). ``hello``: some rank said hello meanwhile."""
        assert self.since is not None
        if alive and not hello and now - self.since < self.hold_s:
            return None
        ranks, codes = sorted(self.exits), set(self.exits.values())
        self.since = None
        if len(ranks) < self.world_size or len(codes) != 1:
            return ranks, None
        code = codes.pop()
        if code == USAGE_EXIT_CODE:
            return ranks, (f"every rank exited with code {code} before ftrun.init, a usage error (the script's "
                           "command line): not restarted, a restart would fail the same way")
        if self.previous == code:
            return ranks, (f"every rank exited with code {code} before ftrun.init in two attempts in a row: a "
                           "start-up failure that restarts do not repair")
        self.previous = code
        return ranks, None

    def new_attempt(self) -> None:
        """A whole-job restart began: forget this attempt's exits (the code of an attempt whose
        ranks all ended alike is kept in :attr:`previous`)."""
        if len(self.exits) < self.world_size or len(set(self.exits.values())) != 1:
            self.previous = None
        self.exits, self.since = {}, None


@dataclass(frozen=True)
class Transfer:
    """One state transfer: ``donor`` sends the state of its replica group to ``recipient``."""

    donor: int
    recipient: int


@dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does in one reconfiguration.

    Attributes:
        step: the recovery step S: every rank resumes training at S + 1 holding the state of S.
        transfers: donor -> recipient state transfers (disjoint recipients).
        rollback: every rank loads its own part of the checkpoint of step S in place (no replica
            held a lost rank's state: :func:`plan_rollback`); there are no transfers.
    """

    step: int
    transfers: tuple[Transfer, ...] = field(default_factory=tuple)
    rollback: bool = False

    @property
    def recipients(self) -> frozenset[int]:
        return frozenset(t.recipient for t in self.transfers)

    @property
    def donors(self) -> frozenset[int]:
        return frozenset(t.donor for t in self.transfers)


class NoLiveReplica(Exception):
    """Some replica group has no live rank holding a usable state: ARF cannot recover it."""


def plan_recovery(committed: Mapping[int, int], replica_groups: Sequence[Sequence[int]]) -> RecoveryPlan:
    """Choose the recovery step and the donor of each rank that needs state.

    The recovery step S is the newest step that *every* replica group can provide: for each group,
    the newest step some live member committed; S is the oldest of those, so that all shards resume
    from the same step. A rank needs state when its committed step differs from S (a respawned rank,
    a survivor whose update for the failing step did not run, or one that ran ahead). Donors are the
    members of the same group that committed S; recipients are spread over them round-robin so that
    several recoveries at once share the load.

    Args:
        committed: live rank -> its committed step (:data:`INITIAL`: the initial state,
            :data:`NO_STATE`: none).
        replica_groups: the partition of ranks into replica groups.

    Raises:
        NoLiveReplica: a group has no live member with usable state, or a group's newest state is
            older than S and no member holds S (shards cannot be brought to one step).
    """
    newest: list[int] = []
    for group in replica_groups:
        steps = [committed[r] for r in group if r in committed and committed[r] > NO_STATE]
        if not steps:
            raise NoLiveReplica(f"no live rank of replica group {rank_ranges(group)} holds the training state (committed or initial)")
        newest.append(max(steps))
    step = min(newest) if newest else -1
    transfers: list[Transfer] = []
    for group in replica_groups:
        donors = sorted(r for r in group if committed.get(r, NO_STATE) == step)
        if not donors:
            raise NoLiveReplica(
                f"replica group {rank_ranges(group)} holds no state at step {step} (shards diverged)"
            )
        recipients = sorted(r for r in group if r in committed and committed[r] != step)
        for i, recipient in enumerate(recipients):
            transfers.append(Transfer(donor=donors[i % len(donors)], recipient=recipient))
    return RecoveryPlan(step=step, transfers=tuple(transfers))


def plan_rollback(committed: Mapping[int, int], checkpoint_step: int | None) -> RecoveryPlan | None:
    """The plan when no live replica holds a lost rank's state (:class:`NoLiveReplica`: pure FSDP
    or tensor parallelism without a replicating dimension): every live rank keeps its process and
    rolls back in place to the newest complete checkpoint of the job, step C, each loading its own
    part of it, and training resumes at C + 1. The steps after C that ranks had committed are
    computed again (:func:`redone_steps`); with data and seeds a function of the step, the run
    still ends bitwise equal to the fault-free one. Gemini keeps such copies in a peer's host
    memory; ftrun's copy is the newest checkpoint (``--save_steps``), so its cost is the
    checkpoints' and its freshness is ``--save_steps`` steps at worst.

    Args:
        committed: live rank -> its committed step.
        checkpoint_step: the newest complete checkpoint this attempt of the job wrote or started
            from (None: there is none, and the job restarts as a whole instead).

    Returns:
        None without a checkpoint, else a plan with ``rollback`` set and no transfers.
    """
    if checkpoint_step is None or not committed:
        return None
    return RecoveryPlan(step=checkpoint_step, rollback=True)


def redone_steps(committed: Mapping[int, int], plan: RecoveryPlan) -> int:
    """How many committed steps a rollback to ``plan.step`` computes again: the newest step a live
    rank had committed, less the recovery step (0 for a plan that keeps every committed step)."""
    return max(0, max(committed.values(), default=plan.step) - plan.step) if plan.rollback else 0


def default_replica_groups(world_size: int) -> list[list[int]]:
    """Pure data parallel: every rank is a replica of every other."""
    return [list(range(world_size))]


def replica_groups_from_hello(world_size: int, declared: Mapping[int, Sequence[int]]) -> list[list[int]]:
    """Build the partition of ranks into replica groups from what each rank declared.

    Args:
        world_size: ranks in the job.
        declared: rank -> the replica group it declared (including itself).

    Raises:
        ValueError: the declarations are not a consistent partition of 0..world_size-1.
    """
    # Ranks of one group declare equal sequences (often one object each, interned at hello): each
    # distinct one is sorted once, so a job of R ranks in groups of G costs O(R) lookups and one sort
    # per group, not R sorts of G ranks (1.3 s at 16,384 ranks in 8 groups).
    everyone = range(world_size)
    by_object: dict[int, tuple[Sequence[int], tuple[int, ...], frozenset[int]]] = {}
    by_value: dict[tuple[int, ...], tuple[tuple[int, ...], frozenset[int]]] = {}
    by_members: dict[tuple[int, ...], tuple[tuple[int, ...], frozenset[int]]] = {}  # sorted -> one object
    found: dict[int, tuple[int, ...]] = {}  # id -> each group, in the order first declared
    for rank in range(world_size):
        seq = declared.get(rank, everyone)
        known = by_object.get(id(seq))
        if known is None or known[0] is not seq:
            value = tuple(seq)
            if value not in by_value:
                ordered = tuple(sorted(value))
                by_value[value] = by_members.setdefault(ordered, (ordered, frozenset(ordered)))
            known = by_object[id(seq)] = (seq, *by_value[value])
        _, group, members = known
        if rank not in members:
            raise ValueError(f"rank {rank} declared replica group {list(group)} without itself")
        found.setdefault(id(group), group)
    groups = found.values()
    seen: set[int] = set()
    for group in groups:
        if seen & set(group):
            raise ValueError(f"replica groups overlap: {[list(g) for g in groups]}")
        seen |= set(group)
    if seen != set(range(world_size)):
        raise ValueError(f"replica groups do not cover ranks 0..{world_size - 1}")
    return [list(g) for g in groups]


def rank_ranges(ranks: Iterable[int]) -> str:
    """Format ranks compactly: [0, 1, 2, 5] -> '0-2,5'."""
    items = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)

"""The vocabulary of ftrun's control plane: each message type and the fields it carries.

One frozen dataclass per :class:`MsgType` lists *every* field a sender puts in that message: the
fields without a default are required, those with a default (``None``: not sent) are optional.
The dataclasses are the one source of truth for the wire: :mod:`ftrun.common.protocol` derives its
checks from them (:func:`accepted_types`, :func:`required_fields`), and a frame whose fields are
not exactly its type's (a missing required field, a field of another type, a field the type does
not have) is rejected as a bad frame.

Types as checked after msgpack decoding: ``int`` takes an int but not a bool, ``float`` an int or a
float (never a bool), ``bool`` only a bool, ``str`` a str; ``list[...]`` and ``dict[...]`` are checked
as a list and a map (their items are the receiver's to check); an optional field takes ``None``
too. :attr:`ftrun.common.protocol.Message.fields` keeps what was sent (an optional field sent as
``None`` is there; one not sent is not: a ``progress`` with ``section: None`` closes the section),
:attr:`ftrun.common.protocol.Message.body` is the typed view (absent optional fields are ``None``).

Who sends what (docs/architecture.md): ranks send the first nine types to the coordinator, which
answers with ``reconfigure``, ``abort``, ``save``, ``finished`` and ``standby``; ``event`` and
``status`` go to each node's launcher; the agent types pass between node agents and the
coordinator (and ``state``, ``stand_by`` and ``take_node`` to standbys).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any


class MsgType(str, Enum):
    """Message types; the value is what travels on the wire."""

    HELLO = "hello"
    HEARTBEAT = "heartbeat"  # a rank's: where its training thread is (its step board: step, phase, ages)
    PROGRESS = "progress"
    FAULT = "fault"
    RECOVERED = "recovered"
    STEPS_END = "steps_end"  # left the step loop: no step watchdog from here on
    DONE = "done"
    ERROR = "error"
    DIVERGENCE = "divergence"  # a recomputed step's local gradient, or replicas' parameters, differ
    RECONFIGURE = "reconfigure"
    ABORT = "abort"
    SAVE = "save"  # write your shard of the given committed step (TTP dying gasp)
    SAVED = "saved"  # a shard file was written (periodic or dying gasp)
    FINISHED = "finished"  # every rank has finished: leave the finish barrier
    EVENT = "event"
    STATUS = "status"
    # node agent <-> coordinator
    AGENT_HELLO = "agent_hello"  # an agent joins (node index, pid, host)
    AGENT_BEAT = "agent_beat"  # liveness, both directions
    SPAWN = "spawn"  # start this incarnation of this rank with these variables
    SPAWNED = "spawned"  # it runs, as this pid
    EXITED = "exited"  # a rank process ended (returncode as Popen gives it)
    STOPPED = "stopped"  # a rank process was stopped by a signal (frozen)
    SIGNAL = "signal"  # send this signal to that rank's process group
    KILL_HUNG = "kill_hung"  # dump a hung rank's stacks into its log, then SIGKILL it
    STACKS = "stacks"  # the stacks a hung rank wrote (answer to kill_hung)
    STOP_RANKS = "stop_ranks"  # stop every rank of the node (SIGTERM, grace, SIGKILL)
    SPARES = "spares"  # keep this many spares (warm or hot, as the variables say)
    SPARE_NOTE = "spare_note"  # what the node's spares showed (a script that breaks the hot-spare contract)
    SHUTDOWN = "shutdown"  # the job is over: exit with this code
    TAKE_NODE = "take_node"  # a standby agent becomes this lost node's agent (its spares take the node's ranks)
    RANK_ORDERS = "rank_orders"  # to an agent: relay this abort or reconfigure to these ranks of the node (ftrun.node.relay)
    RANK_REPORTS = "rank_reports"  # from an agent: its ranks' answers (fault, recovered) to relayed orders
    # coordinator failover (docs/coordinator_failover.md)
    STANDBY = "standby"  # to ranks and agents: the standby coordinator's endpoint and store, to move to if this one dies
    STATE = "state"  # to the standby: the coordinator's hard state (generation, attempt, budget, ranks...)
    STAND_BY = "stand_by"  # to an agent: stand by as the job coordinator (it answers with its endpoint and store)




# ---------------------------------------------------------------- rank -> coordinator
@dataclass(frozen=True, slots=True)
class Hello:
    """A rank's process connects (:func:`ftrun.rank.client.open_channel`); ``rejoin``: said again
    to a coordinator that took over, with ``seen``, the newest generation the rank has seen."""

    rank: int
    incarnation: int
    pid: int
    generation: int
    replica_group: list[int]
    library: bool  # the worker library (ft.init), not a script that only reports
    hot: str | None = None  # a promoted hot spare: what its script waited on at the promotion
    rejoin: bool | None = None
    seen: int | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A rank's heartbeat: its I/O thread's probe (``in_dist``, ``stage``, ``stage_bytes``) and its
    step board (:meth:`ftrun.rank.client.StepBoard.fields`); ages and step times in seconds."""

    rank: int
    incarnation: int
    in_dist: bool | None = None  # the training thread waits inside torch.distributed
    stage: str | None = None  # where it is in ftrun's own flow (setup, init, loop, recover, ...)
    stage_bytes: int | None = None  # the bytes that stage moves
    phase: str | None = None  # a :class:`ftrun.coordinator.ranks.RankPhase` value
    phase_age: float | None = None
    committed: int | None = None
    step: int | None = None
    total: int | None = None  # the loop's steps, when known
    last_step: float | None = None
    compute: float | None = None
    samples: int | None = None  # the number of the newest step-time sample
    step_times: list[float] | None = None
    step_max: float | None = None  # the largest of the new samples not listed
    step_max_from: int | None = None  # the number of the first of those
    sent: int | None = None  # relayed through its node's agent: the frames it had sent the coordinator before this beat


@dataclass(frozen=True, slots=True)
class Progress:
    """``ft.report(step, **metrics)``, or a section opened (``section``, ``section_timeout`` in
    seconds, None: unbounded) or closed (``section`` sent as None)."""

    rank: int
    incarnation: int
    step: int
    metrics: dict[str, Any]
    section: str | None = None
    section_timeout: float | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """A rank's failure report, or its answer to an abort (``kind``: comm, recoverable, abort);
    ``rollback``: its loop can be rolled back in place to a checkpoint."""

    rank: int
    incarnation: int
    generation: int
    step: int
    committed: int
    reason: str
    kind: str | None = None
    rollback: bool | None = None


@dataclass(frozen=True, slots=True)
class Recovered:
    """A rank carried out its part of a recovery plan (``role``: donor, recipient, none, rollback),
    moving ``bytes`` in ``seconds``; ``rebuild_seconds``: building the new group."""

    rank: int
    incarnation: int
    generation: int
    role: str
    bytes: int
    seconds: float
    rebuild_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class StepsEnd:
    """A rank left its step loop: no step watchdog for it from here on."""

    rank: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Done:
    """A rank called ``ft.finish()`` at committed step ``committed``."""

    rank: int
    incarnation: int
    committed: int | None = None


@dataclass(frozen=True, slots=True)
class Error:
    """A problem a rank survived; ``checkpoint``: the step of a periodic checkpoint that failed."""

    rank: int
    incarnation: int
    reason: str
    checkpoint: int | None = None


@dataclass(frozen=True, slots=True)
class Divergence:
    """Exactly-once does not hold at ``step`` (``check``: gradient or replicas)."""

    rank: int
    incarnation: int
    step: int
    check: str
    reason: str


@dataclass(frozen=True, slots=True)
class Saved:
    """A shard file of committed ``step`` was written (``reason``: periodic or dying gasp) in
    ``seconds``; ``info``: :meth:`ftrun.common.checkpoint.ShardInfo.to_json`."""

    rank: int
    incarnation: int
    step: int
    shard: int
    info: dict[str, Any]
    seconds: float
    torch_version: str
    reason: str


# ---------------------------------------------------------------- coordinator -> rank, launcher
@dataclass(frozen=True, slots=True)
class Reconfigure:
    """The recovery plan of ``generation``: resume after ``step``; ``transfers``: the [donor,
    recipient] pairs the receiving rank takes part in (the whole plan is the
    ``recovery_planned`` event's); ``store``: the store after a takeover (``host:port``); ``rollback``: the
    checkpoint directory every rank loads instead."""

    generation: int
    world_size: int
    step: int
    transfers: list[list[int]]
    store: str | None = None
    rollback: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop the group; report your committed step for ``generation``."""

    generation: int
    reason: str


@dataclass(frozen=True, slots=True)
class Save:
    """Write shard ``shard`` of committed ``step`` into ``directory`` (a dying gasp)."""

    generation: int
    step: int
    shard: int
    directory: str
    reason: str


@dataclass(frozen=True, slots=True)
class Finished:
    """Every rank has finished: leave the finish barrier."""


@dataclass(frozen=True, slots=True)
class Event:
    """One event of the job (:meth:`ftrun.common.events.Event.to_json`), for a node's launcher."""

    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Status:
    """A snapshot of every rank's row, for a node's launcher's console."""

    ranks: list[dict[str, Any]]
    attempt: int | None = None
    generation: int | None = None


@dataclass(frozen=True, slots=True)
class Standby:
    """Where to go if this coordinator dies: the first standby's ``control`` endpoint and ``store``
    ("": none), the coordinator ``epoch``, the whole line (``seats``: [control, node], first first)
    and, to ranks, the silence ``timeout`` (seconds) after which to move there."""

    control: str
    store: str
    epoch: int
    seats: list[list[Any]] | None = None
    timeout: float | None = None


# ---------------------------------------------------------------- node agent <-> coordinator
@dataclass(frozen=True, slots=True)
class AgentHello:
    """A node's agent joins; a standby's offer (``standby_control``, ``standby_store``), whether
    it sees the checkpoint directory's marker, and where its node's record store listens
    (``record_store``, ``host:port``: :mod:`ftrun.rank.rankstate`) ride along."""

    node: int
    pid: int
    host: str
    standby_control: str | None = None
    standby_store: str | None = None
    sees_checkpoint_dir: bool | None = None
    record_store: str | None = None


@dataclass(frozen=True, slots=True)
class AgentBeat:
    """Liveness, both ways; from an agent: ``leaving`` (why its node leaves the job), its offer
    to stand by (``standby_control``, ``standby_store``), or its ranks' relayed heartbeats (``ranks``)."""

    node: int
    leaving: str | None = None
    standby_control: str | None = None
    standby_store: str | None = None
    # The node's ranks' heartbeats since the agent's last beat (:mod:`ftrun.node.relay`): one row
    # each, ``[rank, incarnation, age (seconds since the agent received it), sent, board fields]``.
    ranks: list[list[Any]] | None = None


@dataclass(frozen=True, slots=True)
class RankOrders:
    """Relay a recovery round's ``order`` (``abort`` or ``reconfigure``) to these ranks of the node
    (:mod:`ftrun.node.relay`): each rank is sent ``common`` updated with its row's own fields;
    rows ``[rank, incarnation, own fields]``."""

    node: int
    order: str
    common: dict[str, Any]
    ranks: list[list[Any]]


@dataclass(frozen=True, slots=True)
class RankReports:
    """The node's ranks' answers to relayed orders (``fault``, ``recovered``), in the order the agent
    received them: rows ``[type, fields]``, the fields as the rank sent them (its rank and
    incarnation included)."""

    node: int
    reports: list[list[Any]]


@dataclass(frozen=True, slots=True)
class Spawn:
    """Start ``incarnation`` of ``rank`` with ``vars`` (in a spare if ``use_spare``)."""

    rank: int
    incarnation: int
    vars: dict[str, str]
    header: str  # the first line of its log
    use_spare: bool


@dataclass(frozen=True, slots=True)
class Spawned:
    """It runs, as ``pid`` (``spare``: in a spare, of ``spare_kind`` warm or hot)."""

    node: int
    rank: int
    incarnation: int
    pid: int
    spare: bool
    spare_kind: str | None = None


@dataclass(frozen=True, slots=True)
class Exited:
    """A rank process ended (``returncode`` as Popen gives it) at Unix time ``at`` (seconds);
    ``error``: its error file's exception, ``log_tail``: its log's last lines."""

    node: int
    rank: int
    incarnation: int
    pid: int
    returncode: int
    at: float
    error: str | None = None
    log_tail: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """A rank process was stopped by ``signal`` at Unix time ``at`` (seconds)."""

    node: int
    rank: int
    incarnation: int
    pid: int
    signal: int
    at: float


@dataclass(frozen=True, slots=True)
class Signal:
    """Send ``signal`` to that rank's process group."""

    rank: int
    incarnation: int
    signal: int


@dataclass(frozen=True, slots=True)
class KillHung:
    """Write ``line`` into a hung rank's log, dump its stacks (if ``dump``), then SIGKILL it."""

    rank: int
    incarnation: int
    line: str
    dump: bool


@dataclass(frozen=True, slots=True)
class Stacks:
    """The stacks a hung rank wrote (the answer to ``kill_hung``)."""

    node: int
    rank: int
    incarnation: int
    lines: list[str]
    note: str


@dataclass(frozen=True, slots=True)
class StopRanks:
    """Stop every rank of the node: SIGTERM, ``grace`` seconds, SIGKILL."""

    grace: float


@dataclass(frozen=True, slots=True)
class Spares:
    """Keep ``warm`` and ``hot`` spares, with these model ``vars``."""

    warm: int
    hot: int
    vars: dict[str, str]


@dataclass(frozen=True, slots=True)
class SpareNote:
    """What the node's spares showed (a script that breaks the hot-spare contract)."""

    node: int
    message: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The job is over: exit with ``code``; ``rejoin``: fenced, but come back as the node's replacement."""

    code: int
    message: str
    rejoin: bool | None = None


@dataclass(frozen=True, slots=True)
class TakeNode:
    """A standby node's agent becomes lost node ``node``'s."""

    node: int


@dataclass(frozen=True, slots=True)
class State:
    """The coordinator's hard state (:func:`ftrun.coordinator.failover.hard_state`), to a standby:
    a whole one, or its head (:func:`held_state`)."""

    state: dict[str, Any]


def held_state(held: dict[str, Any] | None, state: dict[str, Any]) -> dict[str, Any] | None:
    """The hard state a standby holds once it is sent ``state``, having held ``held`` (None: none):
    a whole state (it has ``ranks``) replaces it; a head (all but the rows and their groups: a large
    job's round start) updates it, keeping its rows, and is dropped while none is held. The
    coordinator keeps its copy of what each standby holds by the same rule."""
    if "ranks" in state:
        return state
    return None if held is None else {**held, **state}


@dataclass(frozen=True, slots=True)
class StandBy:
    """Stand by as the job coordinator (the agent answers with its endpoint and store)."""


#: The body of each message type.
BODIES: dict[MsgType, type] = {
    MsgType.HELLO: Hello, MsgType.HEARTBEAT: Heartbeat, MsgType.PROGRESS: Progress, MsgType.FAULT: Fault,
    MsgType.RECOVERED: Recovered, MsgType.STEPS_END: StepsEnd, MsgType.DONE: Done, MsgType.ERROR: Error,
    MsgType.DIVERGENCE: Divergence, MsgType.RECONFIGURE: Reconfigure, MsgType.ABORT: Abort, MsgType.SAVE: Save,
    MsgType.SAVED: Saved, MsgType.FINISHED: Finished, MsgType.EVENT: Event, MsgType.STATUS: Status,
    MsgType.AGENT_HELLO: AgentHello, MsgType.AGENT_BEAT: AgentBeat, MsgType.SPAWN: Spawn, MsgType.SPAWNED: Spawned,
    MsgType.EXITED: Exited, MsgType.STOPPED: Stopped, MsgType.SIGNAL: Signal, MsgType.KILL_HUNG: KillHung,
    MsgType.STACKS: Stacks, MsgType.STOP_RANKS: StopRanks, MsgType.SPARES: Spares, MsgType.SPARE_NOTE: SpareNote,
    MsgType.SHUTDOWN: Shutdown, MsgType.TAKE_NODE: TakeNode, MsgType.STANDBY: Standby, MsgType.STATE: State,
    MsgType.STAND_BY: StandBy, MsgType.RANK_ORDERS: RankOrders, MsgType.RANK_REPORTS: RankReports,
}

#: What each annotation accepts once decoded (a float field takes an int: msgpack keeps ``1.0`` a float,
#: but a sender may well write ``1``).
_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,), str: (str,),
                                         list: (list,), dict: (dict,), type(None): (type(None),)}


def accepted_types(annotation: Any) -> tuple[type, ...]:
    """The Python types a field annotated ``annotation`` accepts after msgpack decoding.

    Raises:
        TypeError: an annotation the wire cannot carry (a body's definition is wrong).
    """
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(dict.fromkeys(t for arg in typing.get_args(annotation) for t in accepted_types(arg)))
    if origin in (list, dict):
        return (origin,)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"a message field cannot be annotated {annotation!r}")


def field_types(body: type) -> dict[str, tuple[type, ...]]:
    """Every field of the message body ``body`` (a dataclass of :data:`BODIES`) and the types it accepts."""
    hints = typing.get_type_hints(body)
    return {f.name: accepted_types(hints[f.name]) for f in dataclasses.fields(body)}


def required_fields(body: type) -> tuple[str, ...]:
    """The fields of ``body`` a message must carry (those without a default), in order."""
    return tuple(f.name for f in dataclasses.fields(body)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


if set(BODIES) != set(MsgType):  # a new type without its body would fail on its first frame
    raise AssertionError(f"message types without a body: {sorted(t.value for t in set(MsgType) - set(BODIES))}")

"""Coordinator failover: a standby coordinator on node 1 takes the job over when node 0 dies.

Node 0 runs the coordinator and hosts the job's stores; without a standby its loss ends the job
(torchrun's c10d store and TorchFT's lighthouse have the same single point of failure). Node 1's
agent is the **standby** (docs/coordinator_failover.md): before anything fails it binds a control
endpoint and hosts a c10d store of its own, and says so in its hello. Then:

- the coordinator announces the standby (``standby``: its endpoint and store) to every rank and
  agent, standby nodes included;
- it replicates its **hard state** to the standby (``state``): the coordinator epoch, attempt,
  generation, restart budget used, lost nodes and each rank's incarnation, pid, replica group,
  state and committed step. It changes on faults, not per step; it is sent when it changed and at
  every beat to node 1's agent (a few hundred bytes; committed steps ride along).
- **Takeover on a closed connection, or with a majority.** The standby's agent takes the job over
  at once when its connection to the coordinator closes without a ``shutdown``: node 0's
  processes are dead (a killed process's or host's kernel resets its connections), so no second
  coordinator can act. Silence (a partition, a hung host) is a vote: an agent that hears nothing
  from the coordinator for the silence timeout goes to the standby and says hello there; the
  standby, silent too, takes over once more than half of the electorate (the job's agents,
  standby nodes included, as the coordinator last counted them with every one heard, replicated
  in the state) is with it. The coordinator steps down when it hears half of the electorate or
  less (:class:`ftrun.coordinator.membership.QuorumLost`), a heartbeat interval before it would
  find any of them lost; both sides cannot hold a majority, and a partition's two sides cannot
  finish a collective together anyway. With fewer than three agents (a 2-node job) no majority
  exists without node 0: its silence ends the job as before. Ranks hear the coordinator's beats
  (the ``standby`` message again, once a heartbeat interval) and move to the standby on silence
  as on a closed connection.
- The new coordinator runs in node 1's agent process (node 1's ranks are its children already),
  with the epoch and the generation moved on: node 0 is lost like any node, its ranks are recovered
  from replicas once a launcher takes index 0 (a standby node, which moved to the new coordinator
  with the other agents, takes it at once), and every survivor keeps its process. Ranks move their
  control channel to the standby's endpoint when theirs closes, say hello again (same pid, same
  incarnation) and are told the new generation; the recovery plan names the new store, on which
  the next generation's process group is built.

- **A line of two standbys** (:data:`SEATS`): the coordinator asks another node's agent too and
  announces the line (``seats``: control endpoint and node, first first) to ranks and agents. The
  second takes over only once the coordinator's and the first standby's processes are found dead
  (a closed connection, or a refused one: :func:`ftrun.common.protocol.endpoint_refuses`), never on
  silence, so it never competes with the first's majority: node 1 lost while it takes over.
  The line only grows at its end or loses a lost node's entry, so no two agents disagree on
  who is next.

What is lost with node 0: the records of node 0's ranks' own state (RNG, data position) that
lived in its store; a script seeded per step (``init(seed=...)``) needs none, another one reports
the difference with its exactly-once checks. A decision the old coordinator made in the last
beat before it died may not have reached the standby (no acknowledgement is waited for).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from ftrun.coordinator.policy import RankState
from ftrun.common.messages import held_state
from ftrun.common.protocol import MsgType
from ftrun.coordinator.ranks import Incarnation

from ftrun.coordinator.agents import RemoteAgent

if TYPE_CHECKING:
    from ftrun.coordinator.agents import AgentHandle
    from ftrun.coordinator.core import Coordinator
    from ftrun.coordinator.ranks import Rank

log = logging.getLogger("ftrun.coordinator")

STANDBY_NODE = 1  # the node whose agent is the first standby coordinator
SEATS = 2  # standby coordinators kept in line: node 1 may be lost while it takes over from node 0
#: In a job of more than this many ranks, the hard state (a row a rank) goes to the standbys once per
#: this many ranks a second (16,384 ranks: every 8 s), or at once when forced (a round's start),
#: instead of every heartbeat interval: its building, comparing and sending grow with the ranks
#: (docs/scale.md). Forced, only its head goes (the generation and the rest but the rows; 25 to 30 ms
#: less in the path of a 16,384-rank round's abort) to a standby that holds a whole state. A
#: takeover from an older state adopts what it missed (ftrun.coordinator.messages, RankMessages._adopts).
REPLICA_RANKS_PER_S = 2048


#: The coordinator beats the other nodes' agents (and, through them, their ranks) once a heartbeat
#: interval, or, with more than this many nodes, once per this many nodes a second (2,048 nodes:
#: every 2 s; a beat to each agent is a frame sealed for it: O(nodes) a second out of node 0), never
#: less often than 2.5 beats a silence timeout (the agents' and the ranks' deadline for the coordinator).
AGENT_BEATS_PER_S = 1000


def agent_beat_period(spec: Any, nodes: int) -> float:
    """Seconds between two beats of the coordinator to every agent (:data:`AGENT_BEATS_PER_S`)."""
    return max(spec.heartbeat_interval, min(nodes / AGENT_BEATS_PER_S, silence_timeout(spec) / 2.5))


def silence_timeout(spec: Any) -> float:
    """Seconds without a word after which a peer of the control plane is taken as gone: the
    ``--heartbeat_timeout``, at least three heartbeat intervals."""
    return max(spec.heartbeat_timeout, 3 * spec.heartbeat_interval)


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (a host name or address): the one other
    nodes reach it at. No packet is sent (a UDP socket's ``connect`` only picks the route).

    Raises:
        OSError: ``peer`` does not resolve or no route leads to it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(peer), 9))
        return sock.getsockname()[0]


class RankRow(NamedTuple):
    """One rank in the hard state (:func:`hard_state`). It travels as a list of these nine values
    in this order, not as a map, and names its replica group by its place in the state's
    ``groups``: the rows of 16,384 ranks fit one frame (:data:`ftrun.common.protocol.MAX_FRAME_BYTES`),
    whatever the groups' size (a data-parallel job's one group holds every rank: in each row, 16,384
    ranks' rows were 268 million numbers)."""

    rank: int
    incarnation: int
    pid: int  # 0: not known yet
    library: bool  # the rank runs the worker library
    replica_group: int  # its index in the hard state's ``groups``
    restarts: int
    state: str  # a RankState value
    committed: int  # its committed step: moves every step, not a decision (:meth:`decision`)
    running: bool

    @classmethod
    def of(cls, r: "Rank", group: int) -> "RankRow":
        """The row of rank ``r`` now, its replica group at index ``group`` of the state's groups."""
        return cls._make(_wire_row(r, group))

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> "RankRow":
        """A row as it travels (a list of nine values).

        Raises:
            TypeError: not nine values.
        """
        return cls._make(row)

    def to_wire(self) -> list[Any]:
        """The row as it travels: a list of its nine values, in order."""
        return list(self)

    @staticmethod
    def decision(row: Sequence[Any]) -> list[Any]:
        """A row (as it travels) without its committed step: what changes only when the coordinator decides."""
        return [*row[:_COMMITTED], *row[_COMMITTED + 1:]]


_COMMITTED = RankRow._fields.index("committed")


def hard_state(job: "Coordinator", rows: bool = True) -> dict[str, Any]:
    """What a standby needs to go on with the job: the coordinator's hard state (see the module
    docstring), a msgpack-able dict; without ``rows``, its head alone (all but the ranks' rows and
    their groups: :meth:`Replication.replicate`, :meth:`ftrun.node.succession.Succession.hold_state`)."""
    head = {
        "epoch": job.epoch,
        "attempt": job.attempt,
        "generation": job.generation,
        "restarts_used": job.restarts_used,
        "run_id": job.spawning.run_id,
        "lost_nodes": {str(k): v for k, v in job.members.lost_nodes.items()},
        # nodes with an agent now (a lost node a launcher or a standby node took again included),
        # and lost nodes whose replacement is awaited
        "members": sorted([job.spec.node_rank, *(n for n, a in job.members.agents.items() if a.connected())]),
        "awaited": {str(k): v for k, v in job.members.waiting_for.items()},
        "electorate": job.members.electorate,
        # the standby coordinators in line, first first: [node, control endpoint, store]
        "seats": [[seat.node, seat.control, seat.store] for seat in job.failover.seats],
    }
    if not rows:
        return head
    ranks, groups = _rows_and_groups(job)
    head["groups"] = groups  # each replica group the ranks declared, once
    head["ranks"] = ranks  # one RankRow each
    return head


def _rows_and_groups(job: "Coordinator") -> tuple[list[list[Any]], list[list[int]]]:
    """The ranks' rows and the replica groups they name (each once; a group is one object for all
    its ranks, :meth:`ftrun.coordinator.messages.RankMessages.on_hello`, so it is found by its id)."""
    index: dict[int, int] = {}
    groups: list[list[int]] = []
    rows = []
    for r in job.ranks.values():
        at = index.get(id(r.replica_group))
        if at is None:
            at = index[id(r.replica_group)] = len(groups)
            groups.append(list(r.replica_group))
        rows.append(_wire_row(r, at))
    return rows, groups


def _wire_row(r: "Rank", group: int) -> list[Any]:
    """:meth:`RankRow.of`'s values, as the row travels (a list: the hard state is built of these,
    one a rank, without making the named row)."""
    p = r.proc  # every rank, at a round's start: ``_value_``, not the enum's ``value`` property
    return [r.rank, p.number, p.pid or 0, r.library, group, r.restarts, p.state._value_, p.committed, p.running]


def restore(job: "Coordinator", state: dict[str, Any]) -> None:
    """Load a replicated :func:`hard_state` into a new coordinator (the epoch moves on). Every
    live rank is taken as having just been heard from: it says hello again on this coordinator's
    endpoint, and the watchdog counts from now."""
    now = job.clock()
    job.epoch = int(state["epoch"]) + 1
    job.attempt = int(state["attempt"])
    job.generation = int(state["generation"])
    job.restarts_used = int(state["restarts_used"])
    job.spawning.run_id = str(state["run_id"])
    members = {int(n) for n in state.get("members", [])}
    for node, reason in state["lost_nodes"].items():
        if int(node) not in members:  # one that was taken again says hello as the node it is
            job.members.lost_nodes[int(node)] = str(reason)
    for node, reason in state.get("awaited", {}).items():
        job.members.lost_nodes[int(node)] = str(reason)
        job.members.await_replacement(int(node), str(reason), now)
    job.takeover_at = now
    # The standbys after this one in the line it was in stay in line (their agents come here and
    # offer again): a rank that a coordinator which died before announcing any started meanwhile
    # learns where to go from this one's first beat.
    line = [(int(n), str(c), str(st)) for n, c, st in state.get("seats", [])]
    mine = [i for i, (n, _, _) in enumerate(line) if n == job.spec.node_rank]
    for node, control, store in line[mine[0] + 1 if mine else 0:]:
        if node != job.spec.node_rank and node not in job.members.lost_nodes:
            job.failover.seats.append(Seat(node, None, control, store))
    for node in members - {job.spec.node_rank}:
        # every agent of the job comes here within a silence timeout (it moved on the same loss)
        job.members.node_deadline[node] = now + 2 * silence_timeout(job.spec)
        job.members.rejoining.add(node)
    job.members.electorate = int(state.get("electorate", 0))
    groups = [tuple(int(x) for x in group) for group in state["groups"]]  # one object per group, as on_hello keeps them
    for row in map(RankRow.from_wire, state["ranks"]):
        r = job.ranks[int(row.rank)]
        r.proc = Incarnation(number=int(row.incarnation), started_at=now, pid=int(row.pid) or None,
                             running=bool(row.running), state=RankState(row.state), committed=int(row.committed),
                             last_heartbeat=now, last_progress=now, rejoin_by=now + 2 * silence_timeout(job.spec))
        r.library, r.restarts = bool(row.library), int(row.restarts)
        r.replica_group = groups[int(row.replica_group)]


@dataclass
class Seat:
    """A standby coordinator: the node whose agent holds it, that agent (a replacement with the
    node's index does not hold it), its control endpoint and its store (``host:port``)."""

    node: int
    agent: "AgentHandle | None"
    control: str
    store: str


class Replication:
    """The coordinator's side of failover: the standby coordinators it keeps in line (up to
    :data:`SEATS`, the lowest node indexes first), announces to every rank and agent, and
    replicates its hard state to.

    The first in line takes the job over (on a closed connection, or with a majority); the next
    one takes over only once the coordinator's and every earlier standby's processes are found
    dead (their connections closed, or refused): node 1 lost while it takes over from node 0.

    Args:
        job: the coordinator.
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.seats: list[Seat] = []
        self._sent: dict[int, dict[str, Any]] = {}  # node -> the state last sent to its seat
        self._sent_at: dict[int, float] = {}
        self._asked: tuple[int, float] | None = None  # (node, when) asked to stand by, no answer yet
        self._ranks_told_at = 0.0
        self._announced = False  # a standby was announced to ranks: they are beaten from then on

    @property
    def node(self) -> int | None:
        """The node of the first standby in line, or None."""
        return self.seats[0].node if self.seats else None

    def on_standby(self, node: int, control: str, store: str) -> None:
        """Node ``node``'s agent offers to stand by (its hello, or its answer to ``stand_by``):
        put it in line (last, unless it is there already) and announce the line to every rank
        and agent (standby nodes included: they move there too)."""
        job = self.job
        agent = job.members.agents.get(node)  # that agent: a replacement with its index does not stand by
        seat = Seat(node, agent, control, store)
        known = [i for i, s in enumerate(self.seats) if s.node == node]
        if known:
            self.seats[known[0]] = seat
        elif len(self.seats) >= SEATS:
            return  # a late answer (node 1's own offer came meanwhile): the line is full; its seat stays idle
        else:
            self.seats.append(seat)
        self._sent.pop(node, None)
        if self._asked is not None and self._asked[0] == node:
            self._asked = None
        self._announce_all()
        log.info("node %d stands by as the job coordinator (control %s, store %s; %d in line)", node, control, store,
                 len(self.seats))

    def _announce_all(self) -> None:
        job = self.job
        for r in job.ranks.values():
            self.announce(r)
        for agent in [*job.members.agents.values(), *job.members.standby_nodes.values()]:  # standby nodes too
            self.tell(agent)

    def tell(self, agent: "AgentHandle") -> None:
        """Tell an agent the line of standby coordinators (the first's endpoint and store, and every
        one's endpoint and node, first first; empty: none). The standbys' own agents are told too:
        each finds its place in the line there."""
        first = self.seats[0] if self.seats else None
        agent.announce_standby(first.control if first else "", first.store if first else "", self.job.epoch,
                               [[s.control, s.node] for s in self.seats])

    def choose(self, now: float) -> None:
        """Drop the standbys whose node was lost (even when another agent has its index already: a
        standby node took it at once), and ask other nodes' agents, the lowest index first, to
        stand by until :data:`SEATS` do; again after a heartbeat timeout without an answer."""
        job = self.job
        lost = [s for s in self.seats if (s.agent is None and s.node in job.members.lost_nodes)
                or (s.agent is not None and (job.members.agents.get(s.node) is not s.agent or not s.agent.connected()))]
        if lost:
            for seat in lost:
                log.info("the standby coordinator on node %d was lost; asking another node to stand by", seat.node)
                self._sent.pop(seat.node, None)
            self.seats = [s for s in self.seats if s not in lost]
            self._announce_all()  # an empty line: nowhere to go until another stands by
        if len(self.seats) >= SEATS or not job.spec.tft.arf or job.spec.join:
            return
        if self._asked is not None and now - self._asked[1] < job.spec.heartbeat_timeout:
            return
        local = {a.node for a in job.members.agents.values() if not isinstance(a, RemoteAgent)}
        seated = {s.node for s in self.seats}
        for node in sorted(job.members.agents):
            agent = job.members.agents[node]
            if node not in local and node not in seated and agent.connected():
                agent.ask_to_stand_by()
                self._asked = (node, now)
                return

    def announce(self, r: Any) -> None:
        """Tell a rank that said hello where to go if this coordinator dies or falls silent for
        ``timeout`` seconds (told again at every beat: these are the beats a rank hears): the
        first standby (``control``, ``store``) and the whole line (``seats``: [control, node],
        first first); with no standby (its node was lost), an empty ``control``: nowhere."""
        if (self.seats or self._announced) and r.connected():
            self._announced = True
            self.job.send(r, MsgType.STANDBY, **self._standby_fields())

    def _standby_fields(self) -> dict[str, Any]:
        first = self.seats[0] if self.seats else None
        return {"control": first.control if first else "", "store": first.store if first else "", "epoch": self.job.epoch,
                "timeout": float(silence_timeout(self.job.spec)), "seats": [[s.control, s.node] for s in self.seats]}

    def beat_ranks(self, now: float) -> None:
        """Once a heartbeat interval, once a standby was announced: announce it again (or that
        there is none) to every rank. A rank that hears nothing for the silence timeout (a
        partition between it and this coordinator) moves to the standby, as on a closed
        connection. A rank whose beats its agent relays gets it through that agent, one frame a
        node (:mod:`ftrun.node.relay`): 16,384 frames a second out of node 0 otherwise. In a job
        of more nodes than :data:`AGENT_BEATS_PER_S`, as seldom as the agents' own beats
        (:func:`agent_beat_period`: 2 s at 2,048 nodes, always 2.5 beats a silence timeout): the
        frames that carry it to the agents are their beats then."""
        job = self.job
        if not self._announced or now - self._ranks_told_at < agent_beat_period(job.spec, len(job.members.agents)):
            return
        self._ranks_told_at = now
        told = [r for r in job.ranks.values()  # Rank.connected(), inlined: every rank every beat
                if (p := r.proc).running and p.identity is not None and p.kill_reason is None]
        job.rounds.send_order(told, MsgType.STANDBY, self._standby_fields())

    def ranks_heard(self, now: float) -> None:
        """Every rank was just sent a frame (a round's order): any frame is a beat to a rank
        (:mod:`ftrun.rank.channel`), so the next beat is a whole period later; the line of
        standbys it repeats is told at that beat."""
        self._ranks_told_at = now

    def replicate(self, now: float, force: bool = False) -> None:
        """Send the hard state to every standby in line when it changed (``force``: now, before
        what it decided is sent to anyone), and at every beat; in a job of more than
        :data:`REPLICA_RANKS_PER_S` ranks, at most once per that many ranks a second unless forced."""
        job = self.job
        if not force:  # forced at a round's start, whose orders go to every rank at once (ranks_heard)
            self.beat_ranks(now)
        self.choose(now)
        if not self.seats:
            return
        if (not force and len(job.ranks) > REPLICA_RANKS_PER_S
                and all(now - self._sent_at.get(seat.node, 0.0) < len(job.ranks) / REPLICA_RANKS_PER_S
                        for seat in self.seats if seat.agent is not None)):  # a seat with no agent yet is sent nothing
            return
        # Forced in a large job (a round's start, in the path of every rank's abort): the head alone
        # to a seat that holds a whole state already, which it updates; the rows follow at the
        # next period (REPLICA_RANKS_PER_S), as every decision of a large job's rows does.
        head_only = force and len(job.ranks) > REPLICA_RANKS_PER_S and all(
            seat.node in self._sent for seat in self.seats if seat.agent is not None)
        state = hard_state(job, rows=not head_only)
        for seat in self.seats:
            sent = self._sent.get(seat.node)
            if (not force and _same_decisions(state, sent)
                    and now - self._sent_at.get(seat.node, 0.0) < job.spec.heartbeat_interval):
                continue  # only committed steps moved: they ride along with the next beat
            if seat.agent is None:
                continue  # kept from the line before a takeover: its agent has not offered here yet
            seat.agent.replicate(state)
            self._sent[seat.node], self._sent_at[seat.node] = held_state(sent, state), now  # what the seat holds now


def _same_decisions(state: dict[str, Any], sent: dict[str, Any] | None) -> bool:
    """Whether hard state ``state`` holds the decisions ``sent`` held: equal but for the ranks'
    committed steps (which move every step). Rows are compared whole first; only those that differ
    are compared without their committed step (:meth:`RankRow.decision`, without making it)."""
    if sent is None or any(state[k] != sent.get(k) for k in state if k != "ranks") or len(state["ranks"]) != len(sent["ranks"]):
        return False
    c = _COMMITTED
    return all(a == b or (a[:c] == b[:c] and a[c + 1:] == b[c + 1:]) for a, b in zip(state["ranks"], sent["ranks"]))

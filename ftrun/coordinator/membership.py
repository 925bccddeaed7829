"""Node membership: which node's agent is connected, which node is lost, fenced or awaited.

Each node's agent says hello on the control plane and beats; a node is lost when its agent's
connection closes, when it falls silent for ``--heartbeat_timeout``, when it never joins within
``--cluster_time_out``, or when its launcher says it leaves (pod-level rescheduling, MindCluster's
term). A lost node's old connection is fenced (anything it sends later is answered with
``shutdown``); a replacement launcher with the node's index is accepted while it is awaited
(``--node_wait_timeout``), and the awaited indices are published in the job's store
(``ftrun/vacant``) for a launcher started without ``--node_rank``. What a loss does to the ranks
(recovery, restart, failure) is the coordinator's decision: this module reports it.

Standby nodes: a launcher started without ``--node_rank`` after every node has its index connects
its agent with the node index :data:`~ftrun.common.contract.STANDBY_NODE_INDEX` and waits, running spares for
the ranks it may take over (``--standby_spares``, :meth:`ftrun.coordinator.environment.Spawning.keep_spares`).
A lost node is handed at once to the standby that joined first (``take_node``: its agent becomes
the node's agent, its spares take the node's ranks), never to two; with none, the node is awaited
as before, and a standby that joins while a node is awaited takes it at once. A standby whose
agent closes its connection, falls silent or leaves is dropped: it held no rank, so it is no fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ftrun.coordinator.agents import AgentHandle, RemoteAgent
from ftrun.common.contract import STANDBY_NODE_INDEX, VACANT_KEY, record_store_key
from ftrun.common.events import EventKind
from ftrun.common.protocol import Message, MsgType
from ftrun.coordinator.elastic import Shrink
from ftrun.coordinator.failover import agent_beat_period, silence_timeout

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

log = logging.getLogger("ftrun.coordinator")


SpawnOrder = tuple[int, int, Mapping[str, str], str, bool]  # rank, incarnation, variables, log header, use a spare


@dataclass(frozen=True)
class NodeLoss:
    """A node found lost: its index, why (in words, and as a ``cause`` for metrics: connection_closed,
    silent, left, not_joined, replaced), whether a replacement may be awaited, and how long the
    evidence is older than the finding (a silent agent's silence), seconds."""

    node: int
    reason: str
    cause: str
    replaceable: bool = True
    evidence_age: float = 0.0


@dataclass(frozen=True)
class QuorumLost:
    """This coordinator hears half or less of the job's agents while a standby coordinator stands
    by on another node: it may be the side of a partition that the standby's majority replaces
    (:meth:`ftrun.coordinator.seat.StandbySeat.votes`), so it steps down with ``reason``."""

    reason: str


@dataclass(frozen=True)
class NoReplacement:
    """A lost node's replacement did not join in time: the job fails with ``reason``."""

    reason: str


class Membership:
    """The nodes of the job and their agents.

    Args:
        job: the coordinator (its spec, clock, rank table, events and control plane).
        local_agent: node 0's agent, in the coordinator's process (or None in tests).
    """

    def __init__(self, job: "Coordinator", local_agent: AgentHandle | None) -> None:
        self.job = job
        spec = job.spec
        self.agents: dict[int, AgentHandle] = {}
        if local_agent is not None:
            self.agents[local_agent.node] = local_agent
        # node -> when its agent must have joined by: the job's start + --cluster_time_out, or a lost
        # node's loss + --node_wait_timeout (a replacement launcher with its index).
        self.node_deadline = {node: job.clock() + spec.cluster_time_out for node in range(1, spec.nnodes)}
        # node -> since when it is absent (not joined yet, or lost): an elastic job (--nnodes MIN:MAX)
        # runs its ranks elsewhere after --replace_timeout (ftrun.coordinator.elastic)
        self.absent_since = {node: job.clock() for node in range(1, spec.nnodes)}
        self.waiting_for: dict[int, str] = {}  # lost node -> why, while a replacement is awaited
        self.fenced: dict[bytes, int] = {}  # connection of a lost node's agent -> that node
        self.pending_spawns: dict[int, list[SpawnOrder]] = {}  # node -> orders for when its agent joins
        self.lost_nodes: dict[int, str] = {}
        self.standby_nodes: dict[bytes, RemoteAgent] = {}  # standby nodes' agents by connection, the first joined first
        self._took: dict[bytes, int] = {}  # connection of a standby that took a node -> that node
        self.main_store: Any = None  # the launcher's store (vacancies), once the control address is published
        self._next_beat = 0.0
        self._unshared_warned = False
        # The job's agents (standby nodes included) as last counted with every one heard: the
        # electorate of a takeover vote (ftrun.coordinator.failover); a silence does not shrink it.
        self.electorate = 0
        self.rejoining: set[int] = set()  # after a takeover: nodes whose agent is awaited here (ftrun.coordinator.failover)

    def spawn(self, node: int, order: SpawnOrder) -> None:
        """Have ``node``'s agent start a rank, or keep the order until that agent joins."""
        agent = self.agents.get(node)
        if agent is None:
            self.pending_spawns.setdefault(node, []).append(order)
        else:
            agent.spawn(*order)

    def check(self, closed: set[bytes], now: float) -> NodeLoss | NoReplacement | QuorumLost | Shrink | None:
        """Beat to the other nodes' agents and find the first node lost (``closed``: the agent
        connections that closed since the last look), or that this coordinator lost its quorum
        (:meth:`quorum`)."""
        spec = self.job.spec
        timeout = silence_timeout(spec)
        if now >= self._next_beat:
            self._next_beat = now + agent_beat_period(spec, len(self.agents) + len(self.standby_nodes))
            for agent in [*self.agents.values(), *self.standby_nodes.values()]:
                if isinstance(agent, RemoteAgent):
                    if agent.sent == agent.sent_at_beat:  # any other frame since the last look was a beat
                        agent.beat()
                    agent.sent_at_beat = agent.sent
        lost_quorum = self.quorum(closed, now)
        if lost_quorum is not None:
            return lost_quorum
        heard = self.job.heard_until(now)  # an agent's beat waiting unread is no silence
        for identity, standby in list(self.standby_nodes.items()):
            gone = ("its agent's connection closed" if identity in closed
                    else f"its launcher left: {standby.leaving}" if standby.leaving
                    else f"nothing heard from its agent for {heard - standby.last_seen:.1f} s"
                    if heard - standby.last_seen > timeout else None)
            if gone is not None:
                self.drop_standby_node(identity, gone)
        moved = self.job.elastic.moved
        for node in range(spec.nnodes):
            agent = self.agents.get(node)
            if agent is not None:
                self.rejoining.discard(node)
            elif (node not in moved and self.job.elastic.on
                  and now - self.absent_since.get(node, now) > self.job.elastic.wait_for(node in self.lost_nodes)):
                absent = self.elastic_verdict(node)
                if absent is not None:
                    return absent
            remote = agent if isinstance(agent, RemoteAgent) and not agent.lost else None
            if remote is not None and remote.identity in closed:
                return NodeLoss(node, f"node {node} lost: its agent's connection closed (host {remote.host or '?'}; "
                                      "its processes were killed or its host reset the connection)", "connection_closed")
            if agent is None and node in self.waiting_for and now > self.node_deadline[node] and node not in moved:
                return NoReplacement(f"{self.waiting_for.pop(node)}; no replacement joined within --node_wait_timeout "
                                     f"{spec.node_wait_timeout:g} s")
            if agent is None and node in self.rejoining and now > self.node_deadline[node]:
                self.rejoining.discard(node)
                return NodeLoss(node, f"node {node} lost: its agent did not come to this coordinator within "
                                      f"{self.node_deadline[node] - self.job.takeover_at:.1f} s of its takeover", "silent")
            if (agent is None and node not in self.lost_nodes and node not in moved
                    and now > self.node_deadline.get(node, float("inf"))):
                return NodeLoss(node, f"node {node} did not join within --cluster_time_out {spec.cluster_time_out:g} s",
                                "not_joined", replaceable=False)
            if remote is not None and remote.leaving:
                return NodeLoss(node, f"node {node} left the job: {remote.leaving} (host {remote.host or '?'})", "left")
            if remote is not None and heard - remote.last_seen > timeout:
                return NodeLoss(node, f"node {node} lost: nothing heard from its agent for {heard - remote.last_seen:.1f} s "
                                      f"(host {remote.host or '?'}; {self.heard_note(node, heard)})", "silent",
                                evidence_age=heard - remote.last_seen)
        return None

    def elastic_verdict(self, node: int) -> Shrink | NoReplacement | None:
        """An elastic job's ``node`` has been absent for ``--replace_timeout``: its ranks run on the
        present nodes while MIN or more are present; a lost node below MIN ends the job (a node not
        joined at the start is awaited up to ``--cluster_time_out``, as in a fixed-size job)."""
        spec, present = self.job.spec, len(self.agents)
        lost = self.waiting_for.get(node)
        if present >= spec.min_nodes:
            return Shrink(node, f"{lost}; no node took its place within --replace_timeout {spec.replace_timeout:g} s"
                          if lost else f"node {node} has not joined {self.job.elastic.wait_for(False):g} s after the start")
        if lost is not None:
            del self.waiting_for[node]
            return NoReplacement(f"{lost}; no node took its place within --replace_timeout {spec.replace_timeout:g} s "
                                 f"and {present} node(s) are left, below the --nnodes minimum of {spec.min_nodes}")
        return None

    def heard_note(self, silent: int, now: float) -> str:
        """Which side's link failed, as far as this coordinator can tell when ``silent``'s agent fell
        silent: the other nodes it still hears, or that it hears none (its own node's link may be
        the one that is down; with two nodes the two cannot be told apart)."""
        others = sorted(n for n, a in self.agents.items() if n != silent and isinstance(a, RemoteAgent) and not a.lost
                        and now - a.last_seen <= 2 * self.job.spec.heartbeat_interval)
        if others:
            return f"node {self.job.spec.node_rank}'s coordinator still hears node(s) {others}: node {silent}'s link or host failed"
        return (f"no other node's agent is heard either: node {silent}'s link or host failed, or node "
                f"{self.job.spec.node_rank}'s own link")

    def quiet_nodes(self, now: float) -> set[int]:
        """The nodes whose agents have been silent for more than two heartbeat intervals (each
        agent answers every beat): nodes that may be lost, which :meth:`check` declares lost at the
        silence timeout. The watchdog blames no rank for a stalled step meanwhile."""
        limit = 2 * self.job.spec.heartbeat_interval
        return {node for node, agent in self.agents.items()
                if isinstance(agent, RemoteAgent) and not agent.lost and now - agent.last_seen > limit}

    def quorum(self, closed: set[bytes], now: float) -> QuorumLost | None:
        """Count the agents heard (within the silence timeout less a heartbeat interval, so that a
        partition's silent agents all count as unheard before the first of them is found lost);
        with every one heard, that is the :attr:`electorate`. While a standby coordinator stands
        by on another node, hearing half of the electorate or less (three agents or more) is a
        lost quorum: the standby may win a majority on the other side
        (``docs/coordinator_failover.md``)."""
        spec = self.job.spec
        window = silence_timeout(spec) - spec.heartbeat_interval
        until = self.job.heard_until(now)  # a beat waiting unread is no silence
        everyone = [*self.agents.values(), *self.standby_nodes.values()]
        heard = sum(1 for a in everyone if not isinstance(a, RemoteAgent)
                    or (a.identity not in closed and not a.leaving and until - a.last_seen <= window))
        if heard == len(everyone):
            self.electorate = heard
            return None
        standby = self.job.failover.node
        if standby is None or not isinstance(self.agents.get(standby), RemoteAgent) or self.electorate < 3:
            return None
        if 2 * heard > self.electorate:
            return None
        return QuorumLost(f"it hears {heard} of the job's {self.electorate} nodes' agents (nothing from the others for "
                          f"{window:g} s): the standby coordinator on node {standby} may go on with a majority")

    def lose(self, node: int, reason: str) -> None:
        """Record ``node`` as lost: its agent is dropped and its connection fenced; orders for it
        are forgotten."""
        self.rejoining.discard(node)
        agent = self.agents.pop(node, None)
        if isinstance(agent, RemoteAgent):
            agent.lost = True
            self.fenced[agent.identity] = node
        self.pending_spawns.pop(node, None)
        self.lost_nodes[node] = reason
        self.publish_record_store(node, "")

    def await_replacement(self, node: int, reason: str, now: float) -> None:
        """Hand ``node`` to a standby node (:meth:`take_standby_node`), or wait up to
        ``--node_wait_timeout`` for a launcher with its index."""
        self.waiting_for[node] = reason
        self.node_deadline[node] = now + self.job.spec.node_wait_timeout
        self.absent_since[node] = now
        if not self.take_standby_node(node, publish=False):
            self.publish_vacancies()

    def take_standby_node(self, node: int, publish: bool = True) -> bool:
        """Make the standby that joined first the agent of awaited ``node``: it is told
        (``take_node``), orders kept for the node go to it, and its spares take the node's ranks
        (the coordinator respawns them with ``use_spare``). One standby per node, at most: the
        standby leaves the list before it is handed the node. Returns whether one took it
        (``publish``: also update ``ftrun/vacant``)."""
        if node not in self.waiting_for or not self.standby_nodes:
            return False
        identity, agent = next(iter(self.standby_nodes.items()))
        del self.standby_nodes[identity]
        self.waiting_for.pop(node)
        if publish:
            self.publish_vacancies()
        agent.node = node
        self._took[identity] = node
        agent.send_frame(identity, MsgType.TAKE_NODE, {"node": node})
        self.joined(node, agent, f"a standby took node {node} (host {agent.host or '?'}, agent pid {agent.pid})",
                    replacement=True, standby=True)
        return True

    def drop_standby_node(self, identity: bytes, why: str) -> None:
        """Forget a standby node that is gone (no rank was its: no fault)."""
        agent = self.standby_nodes.pop(identity)
        agent.lost = True
        self.job.emit(EventKind.STANDBY_NODE_LEFT, f"a standby node left (host {agent.host or '?'}, agent pid {agent.pid}): "
                      f"{why}; {len(self.standby_nodes)} standby node(s) left", host=agent.host, pid=agent.pid,
                      standby_nodes=len(self.standby_nodes))

    def standby_node_rows(self) -> list[dict[str, Any]]:
        """The standby nodes, first joined first, as ``ftrun status`` lists them (host, agent pid)."""
        return [{"host": a.host, "pid": a.pid} for a in self.standby_nodes.values()]

    def publish_vacancies(self) -> None:
        """Keep ``ftrun/vacant`` in the job's store: the node indices awaiting a replacement,
        comma-separated (a launcher started without ``--node_rank`` takes one; see
        :func:`ftrun.node.launcher.claim_node_rank`)."""
        if self.main_store is None:
            return
        try:
            self.main_store.set(VACANT_KEY, ",".join(str(n) for n in sorted(self.waiting_for)))
        except Exception as err:  # the store is node 0's launcher's: gone only if the job is ending
            log.warning("cannot publish vacant node indices: %s", err)

    def publish_record_store(self, node: int, addr: str) -> None:
        """Keep ``ftrun/record_store/<node>`` in the job's store: where ``node``'s record store
        listens (``addr``, ``host:port``), or nothing while it is lost or has none (``""``). The
        ranks of the node before it copy their records there (:mod:`ftrun.rank.rankstate`)."""
        if self.main_store is None:
            return
        try:
            if addr:
                self.main_store.set(record_store_key(node), addr)
            else:
                self.main_store.delete_key(record_store_key(node))
        except Exception as err:  # the store is node 0's launcher's: gone only if the job is ending
            log.warning("cannot publish node %s's record store: %s", node, err)

    def on_agent_message(self, identity: bytes, msg: Message, fd: int | None = None) -> NodeLoss | None:
        """An agent's hello, beat or report. A hello binds the node to the connection that sent
        it (a replacement for a lost node is accepted while it is awaited); any other agent message
        must come from that connection; a fenced connection (a lost node's old agent, back after a
        partition) is told to shut down. Returns the loss of a node whose replacement said hello
        while its old agent was silent (the caller handles it, then the hello again)."""
        job = self.job
        now = job.clock()
        node = msg.get("node")
        if identity in self.fenced:
            self.fence(identity, msg.type.value)
            return None
        if msg.type == MsgType.AGENT_HELLO:
            return self.on_hello(identity, msg, fd, now)
        standby = self.standby_nodes.get(identity)
        if standby is not None and node == STANDBY_NODE_INDEX:
            standby.on_message(msg, now)
            return None
        if node == STANDBY_NODE_INDEX and identity in self._took:
            node = self._took[identity]  # sent before it read its take_node
        agent = self.agents.get(node) if isinstance(node, int) else None
        if not isinstance(agent, RemoteAgent) or agent.identity != identity or agent.lost:
            job.control.reject(identity, f"{msg.type.value} from a connection that is not node {node!r}'s agent")
            return None
        agent.on_message(msg, now)
        if msg.type == MsgType.AGENT_BEAT and msg.get("ranks"):
            job.messages.on_relayed(node, msg["ranks"])
        elif msg.type == MsgType.RANK_REPORTS:
            job.messages.on_relayed_answers(node, msg["reports"])
        return None

    def fence(self, identity: bytes, what: str) -> None:
        """A lost node's old agent sent ``what`` (a message type: its link is back, after a partition
        or a flap): it is told to stop its ranks, which belong to an old generation. While the node is still awaited, the
        same agent may take it back (``rejoin``: it says hello again on a fresh connection and is
        accepted as the node's replacement, its ranks respawned and recovered from replicas); once
        another launcher took the node, it shuts down."""
        node = self.fenced[identity]
        rejoin = node in self.waiting_for and node not in self.agents
        self.job.control.reject(identity, f"{what} from node {node}'s old agent, which was declared lost: fenced "
                                          f"(told to stop its ranks{' and rejoin as its replacement' if rejoin else ''})")
        self.job.control.send(identity, MsgType.SHUTDOWN, {"code": 1, "rejoin": rejoin, "message": (
            f"node {node} was declared lost and is fenced off; its ranks belong to an old generation and are stopped"
            + ("; it may rejoin as the node's replacement" if rejoin else ""))})

    def on_hello(self, identity: bytes, msg: Message, fd: int | None, now: float) -> NodeLoss | None:
        job, spec = self.job, self.job.spec
        node = msg.get("node")
        if node == STANDBY_NODE_INDEX and identity not in self.standby_nodes and identity not in self._took:
            return self.on_standby_node_hello(identity, msg, fd, now)
        # Node 0 is the coordinator's own until a standby took over from it: then a launcher
        # replaces it like any lost node (and after a takeover its agent, there, says hello again).
        if (not isinstance(node, int) or not 0 <= node < spec.nnodes
                or (node == 0 and job.epoch == 0 and 0 not in self.waiting_for)):
            job.control.reject(identity, f"agent hello for node {node!r}: not a node of this job")
            return None
        current = self.agents.get(node)
        if isinstance(current, RemoteAgent) and spec.tft.arf and now - current.last_seen > 2 * spec.heartbeat_interval:
            # A replacement launcher (a restarted pod) can say hello before the old agent's
            # silence reaches --heartbeat_timeout: the old one is already quiet, so it is lost.
            return NodeLoss(node, f"node {node} replaced: a new launcher joined while its agent had "
                                  f"been silent for {now - current.last_seen:.1f} s", "replaced", evidence_age=now - current.last_seen)
        if node in self.agents or (node in self.lost_nodes and node not in self.waiting_for):
            why = "was declared lost and is not awaited any more" if node in self.lost_nodes else "is already connected"
            job.control.reject(identity, f"agent hello for node {node}, which {why}")
            job.control.send(identity, MsgType.SHUTDOWN, {"code": 1, "message": f"node {node} {why}"})
            return None
        replacing = self.waiting_for.pop(node, None)
        if replacing is not None:
            self.publish_vacancies()
        agent = RemoteAgent(node=node, identity=identity, send_frame=job.control.send, last_seen=now,
                            host=msg["host"], pid=msg["pid"], record_store=msg.get("record_store") or "")
        job.control.watch_agent_connection(fd, identity)
        self.joined(node, agent, f"{'a replacement for ' if replacing else ''}node {node} joined (host {msg['host']}, "
                                 f"agent pid {msg['pid']})", hello=msg, replacement=replacing is not None)
        self.check_shared_dir(msg, f"node {node}")
        return None

    def on_standby_node_hello(self, identity: bytes, msg: Message, fd: int | None, now: float) -> None:
        """A standby node's agent says hello: it waits in :attr:`standby_nodes` (or takes an awaited node at once)."""
        job = self.job
        agent = RemoteAgent(node=STANDBY_NODE_INDEX, identity=identity, send_frame=job.control.send, last_seen=now,
                            host=msg["host"], pid=msg["pid"], record_store=msg.get("record_store") or "")
        self.standby_nodes[identity] = agent
        job.control.watch_agent_connection(fd, identity)
        job.emit(EventKind.STANDBY_NODE_JOINED,
                 f"a standby node joined (host {msg['host']}, agent pid {msg['pid']}): it takes the next lost node; "
                 f"{len(self.standby_nodes)} standby node(s)", host=msg["host"], pid=msg["pid"], standby_nodes=len(self.standby_nodes))
        self.check_shared_dir(msg, "a standby node")
        if job.failover.node is not None:  # where to go if this coordinator dies
            job.failover.tell(agent)
        for node in sorted(self.waiting_for):
            if self.take_standby_node(node):
                break

    def joined(self, node: int, agent: RemoteAgent, message: str, hello: Message | None = None, **detail: Any) -> None:
        """``agent`` is ``node``'s agent from now on: it learns where the standby coordinator is (or,
        its ``hello`` offering to stand by, becomes it), and the orders kept for the node go to it."""
        job = self.job
        self.agents[node] = agent
        self.publish_record_store(node, agent.record_store)
        job.emit(EventKind.NODE_JOINED, message, node_joined=node, **detail)
        if hello is not None and isinstance(hello.get("standby_control"), str) and isinstance(hello.get("standby_store"), str):
            job.failover.on_standby(node, hello["standby_control"], hello["standby_store"])
        elif job.failover.node is not None:
            job.failover.tell(agent)
        self.absent_since.pop(node, None)
        for order in self.pending_spawns.pop(node, []):
            job.ranks[order[0]].proc.started_at = job.clock()  # its set-up time counts from now
            agent.spawn(*order)
        job.elastic.on_joined(node)  # an elastic job's ranks of the node, run elsewhere meanwhile, come back

    def check_shared_dir(self, msg: Message, who: str) -> None:
        """Warn once when an agent does not see node 0's checkpoint directory (TTP)."""
        job = self.job
        if job.spec.tft.ttp and msg.get("sees_checkpoint_dir") is False and not self._unshared_warned:
            self._unshared_warned = True
            job.emit(EventKind.WARNING,
                     f"--checkpoint_dir {job.ttp.root} is not shared with {who} (host {msg['host']}): "
                     "checkpoints need one directory every node sees (a shared file system); shards written "
                     "there would be missing here")

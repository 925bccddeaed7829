"""Node membership: which node's agent is connected, which node is lost, fenced or awaited.

Each node's agent says hello on the control plane and beats; a node is lost when its agent's
connection closes, when it falls silent for ``--heartbeat_timeout``, when it never joins within
``--cluster_time_out``, or when its launcher says it leaves (pod-level rescheduling, MindCluster's
term). A lost node's old connection is fenced (anything it sends later is answered with
``shutdown``); a replacement launcher with the node's index is accepted while it is awaited
(``--node_wait_timeout``), and the awaited indices are published in the job's store
(``ftrun/vacant``) for a launcher started without ``--node_rank``. What a loss does to the ranks
(recovery, restart, failure) is the coordinator's decision: this module reports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..agent import AgentHandle, RemoteAgent
from ..contract import VACANT_KEY
from ..events import EventKind
from ..protocol import Message, MsgType

if TYPE_CHECKING:
    from .core import Coordinator

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
        self.waiting_for: dict[int, str] = {}  # lost node -> why, while a replacement is awaited
        self.fenced: dict[bytes, int] = {}  # connection of a lost node's agent -> that node
        self.pending_spawns: dict[int, list[SpawnOrder]] = {}  # node -> orders for when its agent joins
        self.lost_nodes: dict[int, str] = {}
        self.main_store: Any = None  # the launcher's store (vacancies), once the control address is published
        self._next_beat = 0.0
        self._unshared_warned = False

    def spawn(self, node: int, order: SpawnOrder) -> None:
        """Have ``node``'s agent start a rank, or keep the order until that agent joins."""
        agent = self.agents.get(node)
        if agent is None:
            self.pending_spawns.setdefault(node, []).append(order)
        else:
            agent.spawn(*order)

    def check(self, closed: set[bytes], now: float) -> NodeLoss | NoReplacement | None:
        """Beat to the other nodes' agents and find the first node lost (``closed``: the agent
        connections that closed since the last look)."""
        spec = self.job.spec
        timeout = max(spec.heartbeat_timeout, 3 * spec.heartbeat_interval)
        if now >= self._next_beat:
            self._next_beat = now + spec.heartbeat_interval
            for agent in self.agents.values():
                if isinstance(agent, RemoteAgent):
                    agent.beat()
        for node in range(spec.nnodes):
            agent = self.agents.get(node)
            remote = agent if isinstance(agent, RemoteAgent) and not agent.lost else None
            if remote is not None and remote.identity in closed:
                return NodeLoss(node, f"node {node} lost: its agent's connection closed (host {remote.host or '?'}; "
                                      "its processes were killed or its host reset the connection)", "connection_closed")
            if agent is None and node in self.waiting_for and now > self.node_deadline[node]:
                return NoReplacement(f"{self.waiting_for.pop(node)}; no replacement joined within --node_wait_timeout "
                                     f"{spec.node_wait_timeout:g} s")
            if agent is None and node not in self.lost_nodes and now > self.node_deadline.get(node, float("inf")):
                return NodeLoss(node, f"node {node} did not join within --cluster_time_out {spec.cluster_time_out:g} s",
                                "not_joined", replaceable=False)
            if remote is not None and remote.leaving:
                return NodeLoss(node, f"node {node} left the job: {remote.leaving} (host {remote.host or '?'})", "left")
            if remote is not None and now - remote.last_seen > timeout:
                return NodeLoss(node, f"node {node} lost: nothing heard from its agent for {now - remote.last_seen:.1f} s "
                                      f"(host {remote.host or '?'})", "silent", evidence_age=now - remote.last_seen)
        return None

    def lose(self, node: int, reason: str) -> None:
        """Record ``node`` as lost: its agent is dropped and its connection fenced; orders for it
        are forgotten."""
        agent = self.agents.pop(node, None)
        if isinstance(agent, RemoteAgent):
            agent.lost = True
            self.fenced[agent.identity] = node
        self.pending_spawns.pop(node, None)
        self.lost_nodes[node] = reason

    def await_replacement(self, node: int, reason: str, now: float) -> None:
        """Wait up to ``--node_wait_timeout`` for a launcher with ``node``'s index."""
        self.waiting_for[node] = reason
        self.node_deadline[node] = now + self.job.spec.node_wait_timeout
        self.publish_vacancies()

    def publish_vacancies(self) -> None:
        """Keep ``ftrun/vacant`` in the job's store: the node indices awaiting a replacement,
        comma-separated (a launcher started without ``--node_rank`` takes one; see
        :func:`ftrun.launcher.claim_node_rank`)."""
        if self.main_store is None:
            return
        try:
            self.main_store.set(VACANT_KEY, ",".join(str(n) for n in sorted(self.waiting_for)))
        except Exception as err:  # the store is node 0's launcher's: gone only if the job is ending
            log.warning("cannot publish vacant node indices: %s", err)

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
            job.control.reject(identity, f"{msg.type.value} from node {self.fenced[identity]}'s old agent, which was "
                                         "declared lost: fenced (told to stop its ranks)")
            job.control.send(identity, MsgType.SHUTDOWN, {"code": 1, "message": (
                f"node {self.fenced[identity]} was declared lost and is fenced off; its ranks belong to an old "
                "generation and are stopped")})
            return None
        if msg.type == MsgType.AGENT_HELLO:
            return self.on_hello(identity, msg, fd, now)
        agent = self.agents.get(node) if isinstance(node, int) else None
        if not isinstance(agent, RemoteAgent) or agent.identity != identity or agent.lost:
            job.control.reject(identity, f"{msg.type.value} from a connection that is not node {node!r}'s agent")
            return None
        agent.on_message(msg, now)
        return None

    def on_hello(self, identity: bytes, msg: Message, fd: int | None, now: float) -> NodeLoss | None:
        job, spec = self.job, self.job.spec
        node = msg.get("node")
        # Node 0 is the coordinator's own until a standby took over from it: then a launcher
        # replaces it like any lost node.
        if not isinstance(node, int) or not 0 <= node < spec.nnodes or (node == 0 and 0 not in self.waiting_for):
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
                            host=msg["host"], pid=msg["pid"])
        self.agents[node] = agent
        job.control.watch_agent_connection(fd, identity)
        job.emit(EventKind.NODE_JOINED,
                 f"{'a replacement for ' if replacing else ''}node {node} joined (host {msg['host']}, agent pid {msg['pid']})",
                 node_joined=node, replacement=replacing is not None)
        if spec.tft.ttp and msg.get("sees_checkpoint_dir") is False and not self._unshared_warned:
            self._unshared_warned = True
            job.emit(EventKind.WARNING,
                     f"--checkpoint_dir {job.ttp.root} is not shared with node {node} (host {msg['host']}): "
                     "checkpoints need one directory every node sees (a shared file system); shards written "
                     "there would be missing here")
        if isinstance(msg.get("standby_control"), str) and isinstance(msg.get("standby_store"), str):
            job.failover.on_standby(node, msg["standby_control"], msg["standby_store"])
        elif job.failover.node is not None:
            agent.announce_standby(job.failover.control, job.failover.store, job.epoch)
        for order in self.pending_spawns.pop(node, []):
            job.ranks[order[0]].proc.started_at = job.clock()  # its set-up time counts from now
            agent.spawn(*order)
        return None

"""The standby coordinator's seat, held by a node's agent process (:mod:`.failover` has the protocol).

Node 1's agent (and a second node's, the next in line) binds a control endpoint and hosts a c10d
store before anything fails; when node 0's coordinator is gone (its connection closed, or a majority
of the job's agents hear nothing from it), the seat runs the job's :class:`~.core.Coordinator` in that
agent's process, from the hard state last replicated to it. The seat is the only place outside the
coordinator's own process that builds a coordinator, so this module imports the core and nothing in
the core imports it (the agent does, lazily, when it stands by).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import zmq

from ftrun.common.stores import serve_store
from ftrun.node.supervisor import start_job_metrics
from ftrun.coordinator.agents import LocalAgent
from ftrun.coordinator.control import ControlPlane
from ftrun.coordinator.core import Coordinator
from ftrun.coordinator.failover import address_towards


class StandbySeat:
    """What node 1's agent holds ready before anything fails: a bound control endpoint (nothing
    on it is read until a takeover; what ranks send there meanwhile waits in its queue) and a c10d
    store, both on this host's address towards ``--master_addr``; and the hard state last
    replicated to it.

    Args:
        spec: the job, as this node's launcher resolved it (its ``node_rank`` is this node's).
        token: the job secret.

    Raises:
        OSError: no address towards the master address, or nothing can be bound on it.
        ftrun.common.stores.StoreBindError: the store cannot be hosted.
    """

    def __init__(self, spec: Any, token: str) -> None:
        self.spec, self.token = spec, token
        self.host = address_towards(spec.master_addr)
        self.ctx = zmq.Context()
        self.control = ControlPlane(self.ctx, token, self.host, self.host)
        self.store, self.port = serve_store(self.host, 0, spec.cluster_time_out)
        self.state: dict[str, Any] | None = None

    @property
    def store_addr(self) -> str:
        return f"{self.host}:{self.port}"

    def votes(self) -> tuple[int, int]:
        """The coordinator is silent (a partition or a hung host, not a closed connection): (the
        nodes that agree, the electorate). This standby votes for itself; every other agent that
        said hello on its endpoint lost touch with the coordinator too (an agent goes there only
        then). The electorate is the job's agents, standby nodes included, as the coordinator last
        counted them with every one heard (:attr:`ftrun.coordinator.membership.Membership.electorate`).
        A takeover needs more than half of it: the coordinator steps down when it hears half or less
        (:class:`ftrun.coordinator.membership.QuorumLost`), so both sides cannot go on."""
        assert self.state is not None
        return 1 + len(self.control.hold()), int(self.state.get("electorate", 0))

    def elected(self) -> bool:
        """Whether a majority of the electorate agrees that the coordinator is gone (:meth:`votes`)."""
        agree, electorate = self.votes()
        return electorate >= 3 and 2 * agree > electorate

    def take_over(self, processes: Any, events_addr: str | None, node: int, audience: int,
                  lost: list[int] | tuple[int, ...] = (0,), cause: str = "") -> int:
        """Run the job's coordinator here, from the last replicated state, as node ``node``, with
        this node's ranks (``processes``, a :class:`ftrun.node.spawner.RankProcesses`) as its local
        agent's, its events for this node's launcher (which knows it as node ``audience``: a
        standby node's keeps its first index); ``lost``: the nodes whose coordinator or standby
        died (the coordinator's first); ``cause``: why, in words (default: the coordinator's
        connection closed); returns the job's exit code."""
        assert self.state is not None
        spec = dataclasses.replace(self.spec, master_addr=self.host, master_port=self.port, node_rank=node)
        metrics, spec = start_job_metrics(spec)  # the job's metrics are served from here now
        coordinator = Coordinator(spec, self.token, events_addr, self.port, LocalAgent(node, processes),
                                  control=self.control, audience=audience)
        if metrics is not None:
            coordinator.observers.append(metrics.observe)
        try:
            return coordinator.run(takeover=self.state, lost=[n for n in lost if n >= 0 and n != node], cause=cause)
        finally:
            self.ctx.term()

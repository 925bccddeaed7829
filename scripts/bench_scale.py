"""The control plane at scale, simulated: node 0's costs at 256 to 16,384 ranks on one machine.

The job coordinator is the real one (:class:`ftrun.coordinator.Coordinator`, its main loop
``run()``, its ZeroMQ ROUTER, the real frame authentication, status publishing and events), in a
process of its own, as node 0's supervisor runs it. The job's store is the real one too
(:func:`ftrun.common.stores.serve_store`, a torch ``TCPStore``), in another process, as node 0's launcher
hosts it. Only the ranks and the other nodes' agents are simulated, many per process and without
torch: each simulated rank has its own DEALER connection, its own frame session
(:class:`ftrun.common.protocol.Sender`) and its own :class:`ftrun.rank.client.StepBoard`, and sends what a rank
of the worker library sends (``hello``, a ``heartbeat`` with its step board every
``--heartbeat_interval``, ``fault`` in answer to an abort, ``recovered`` after a plan); each
simulated agent says hello, beats, answers ``spawn`` with ``spawned`` and starts the new rank's
connection, reports a rank's exit, and offers a standby seat when asked (``stand_by``: the
coordinator then keeps standbys in line, replicates its hard state to them and beats every rank).
With the relay (``--heartbeat_relay on``) a rank of a node other than 0 beats its agent, whose beat
carries the rows (:class:`ftrun.node.relay.RelayedBeats`: the newer of a rank's two beats an interval,
the only one simulated), and a round's orders and answers go
through the agent (``rank_orders``, ``rank_reports``; the agent-to-rank hop, local to each node, is
not simulated). Rank-state records go through the real :class:`ftrun.rank.rankstate.RankStateStore`
(one client per store and simulation process, not one per rank).
Node 0's own agent is :class:`SimLocalAgent`, an :class:`ftrun.coordinator.agents.AgentHandle` that starts no
process: its ranks are simulated like the others.
The simulation processes run under ``SCHED_BATCH`` (``--sim_sched``, :func:`simulation_scheduling`):
they stand for other machines, whose wake-ups never preempt node 0's coordinator; they keep a
nice-0 process's share of the two cores.

Per size (``--ranks``, 8 ranks a node with ``--per_node``), in order:

1. start: every agent and rank says hello; the job runs;
2. steady state: once the coordinator has caught up with the start (it handles no more frames a
   second than arrive), a window of ``--window`` seconds (scaled with the ranks) in which node 0's
   coordinator's CPU (every thread of its process: the ZeroMQ I/O thread too), the simulation
   processes' CPU, the messages and bytes sent to it and those it handled are counted;
3. one rank's death (its agent reports the exit at once, as it does after ``SIGCHLD``): the times
   to the round's start, to the abort received by every rank, to the recovery plan (decided;
   received by every rank) and to the end of the round (the respawned rank starts at once: what is
   left is the control plane's part);
4. one node's silence (its agent and ranks stop sending; their connections stay open, a hung
   host): the time to the coordinator's verdict (``node_lost``), and the one-node recovery round on
   the standby node that takes its place;
5. the rank-state records of ``--store_steps`` steps (a ``--record_bytes`` record and a gradient
   digest per rank and step, what word_lm writes): with ``--record_stores node`` (the default) to
   each rank's node's record store and a copy at its buddy's, found through the job's store as a
   rank finds them (:func:`ftrun.rank.rankstate.record_stores`; each simulation process hosts one
   store for its nodes'), with ``job`` into node 0's job store (the design before). Operations and
   bytes per step into node 0's job store and into node 0's record store, the most into any one
   node's, the buddy look-ups (once per rank and generation), and the job store's process's CPU.

Node 0's memory (RSS of the coordinator's and the store's processes) is read at the end.
``FTRUN_BENCH_PROFILE=PATH`` writes a cProfile of the coordinator's main loop over the steady state
(``FTRUN_BENCH_PROFILE_PHASE=round``: over the rank death's round instead); ``FTRUN_BENCH_PYSPY=PATH``
a py-spy sampling of the coordinator's process over the steady state (raw, a line a stack: far
less overhead than cProfile, whose share of each function is skewed towards many small calls;
with ``FTRUN_BENCH_PROFILE_PHASE=round``, the 3 s from the rank's death; ``node``, the 2 s from
the node's verdict). ``FTRUN_BENCH_TIMINGS=PATH`` writes a line for each call of the coordinator's
round, passes and reading (:data:`TIMED_CALLS`) that takes 3 ms or more, with its wall and CPU time.
Each size has a time cap (``--cap``): a phase that does not finish in it is reported as such, with
what was measured before it. The machine's other load shows in every figure: run it on an idle
machine for figures worth quoting, and read them as one run's.

Usage::

    python scripts/bench_scale.py --ranks 1024,4096,16384 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ftrun.common.contract import GENERATION, STANDBY_NODE_INDEX  # noqa: E402
from ftrun.common.protocol import CONTROL, MsgType, encode  # noqa: E402

PER_NODE = 8
RECORD_BYTES = 18_912  # word_lm's rank-state record (docs/benchmarks.md)


def sockets_per_process(descriptors: int) -> int:
    """The sockets one simulation process opens at most, when a process may open ``descriptors``
    files (``ulimit -n``): a ZeroMQ socket takes two (its connection and its mailbox), with 2,000
    left for the rest; 8,000 at most. As few processes as that allows: each adds its own loop and
    ZeroMQ I/O thread to node 0's two cores (16,384 ranks in three processes, not five: node 0's
    coordinator 22.5-23.0% of a core in steady state instead of 23.0-25.6%, its one-node round
    0.47-0.53 s instead of 0.50-0.53 s, in runs taken in turns)."""
    return max(500, min(8000, (descriptors - 2000) // 2))


try:
    import resource

    SOCKETS_PER_PROCESS = sockets_per_process(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except (ImportError, ValueError, OSError):  # no resource module (not POSIX), or no limit to read
    SOCKETS_PER_PROCESS = 4000
TOKEN = "s" * 64
STANDBY_SEAT_PORT = 9  # a simulated standby coordinator's endpoint: named in messages, never connected to
_ORDERS = {t.value: t for t in (MsgType.ABORT, MsgType.RECONFIGURE, MsgType.STANDBY)}  # a relayed order's type, by name
SIM_PID_BASE = 1 << 23  # simulated ranks' pids: above any real one (pid_max is at most 2^22)


def sim_pid(rank: int, incarnation: int) -> int:
    """The pid a simulated rank's process reports (its agent and its hello must agree)."""
    return SIM_PID_BASE + rank * 16 + incarnation % 16


def replica_group(rank: int, world: int, per_node: int) -> list[int]:
    """The ranks holding the same state as ``rank`` with tensor parallelism inside a node and data
    parallelism across nodes (the usual layout of a large job): the same local rank on every node."""
    local = rank % per_node
    return list(range(local, world, per_node))


def default_window(ranks: int) -> float:
    """Seconds of steady state measured at ``ranks`` ranks (longer for more ranks, whose per-second
    figures start later; capped so that the four sizes fit in a few minutes)."""
    return min(12.0, 4.0 + ranks / 2048)


def plan_processes(nodes: int, per_node: int, limit: int = SOCKETS_PER_PROCESS) -> list[list[int]]:
    """Split the nodes (index 0..nodes-1, plus one standby node, :data:`STANDBY_NODE_INDEX`) over
    as few simulation processes of at most ``limit`` sockets each (a node: its agent and its
    ranks) as fit them, evenly.
    Node 0's ranks have no agent socket (their agent is the coordinator's)."""
    per_process = max(1, limit // (per_node + 1))
    order = list(range(nodes)) + [STANDBY_NODE_INDEX]
    parts = -(-len(order) // per_process)
    size = -(-len(order) // parts)  # as many nodes in each (the last one fewer)
    return [order[i:i + size] for i in range(0, len(order), size)]


# --------------------------------------------------------------------------- node 0's agent
class SimLocalAgent:
    """Node 0's agent in the coordinator's process, starting no process: every spawn is reported
    at once with the simulated rank's pid (its rank connects from a simulation process)."""

    def __init__(self, node: int = 0) -> None:
        self.node = node
        self.leaving = None
        self._reports: list[Any] = []

    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> None:
        from ftrun.coordinator.agents import Spawned

        self._reports.append(Spawned(rank, incarnation, sim_pid(rank, incarnation), "warm" if use_spare else ""))

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        pass

    def kill_hung(self, rank: int, incarnation: int, line: str, dump: bool) -> None:
        pass

    def stop_ranks(self, grace_period: float) -> None:
        pass

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> None:
        pass

    def shutdown(self, code: int, message: str) -> None:
        pass

    def announce_standby(self, control: str, store: str, epoch: int, seats: Any = None) -> None:
        pass

    def replicate(self, state: dict[str, Any]) -> None:
        pass

    def ask_to_stand_by(self) -> None:
        pass

    def take_reports(self) -> list[Any]:
        out, self._reports = self._reports, []
        return out

    def connected(self) -> bool:
        return True

    def note_child_signal(self, at: float) -> None:
        pass

    def start_note(self) -> str | None:
        return None


def _as_agent_handle() -> type:
    """:class:`SimLocalAgent` as an :class:`ftrun.coordinator.agents.AgentHandle` (imported in the coordinator's process only)."""
    from ftrun.coordinator.agents import AgentHandle

    return type("SimLocalAgentHandle", (SimLocalAgent, AgentHandle), {})


# --------------------------------------------------------------------------- node 0's processes
def store_main(conn: Any) -> None:
    """Node 0's launcher's part: host the job's store (the real one) until killed."""
    from ftrun.common.stores import serve_store

    store, port = serve_store("127.0.0.1", 0, 600.0)
    conn.send(port)
    signal.pause()
    del store


def coordinator_main(conn: Any, ranks: int, per_node: int, store_port: int, log_dir: str, stats_path: str,
                     interval: float, heartbeat_timeout: float) -> None:
    """Node 0's supervisor: the real coordinator and its main loop. A thread writes the messages
    it handled (by type) to ``stats_path`` twice a second."""
    import faulthandler
    import threading

    from ftrun.config import JobSpec

    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the driver's look at a stuck phase
    from ftrun.coordinator import Coordinator

    spec = JobSpec(script="simulated.py", worker_num=ranks, local_worker_num=per_node, node_rank=0,
                   master_addr="127.0.0.1", master_port=store_port, log_dir=log_dir,
                   checkpoint_dir=os.path.join(log_dir, "ckpt"), max_restarts=1_000_000,
                   heartbeat_interval=interval, heartbeat_timeout=heartbeat_timeout)
    coord = Coordinator(spec, TOKEN, None, store_port, local_agent=_as_agent_handle()())
    handled: dict[str, int] = {}
    on_rank, on_agent = coord.control.on_rank, coord.control.on_agent

    def count_rank(identity: bytes, msg: Any) -> None:
        handled[msg.type.value] = handled.get(msg.type.value, 0) + 1
        on_rank(identity, msg)

    def count_agent(identity: bytes, msg: Any, fd: int | None) -> None:
        handled[msg.type.value] = handled.get(msg.type.value, 0) + 1
        on_agent(identity, msg, fd)

    coord.control.on_rank, coord.control.on_agent = count_rank, count_agent

    import gc

    collections = {"count": 0, "seconds": 0.0, "gen2": 0}  # the cyclic garbage collector's passes
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collections["count"] += 1
            collections["seconds"] += time.perf_counter() - began[0]
            collections["gen2"] += info.get("generation") == 2

    gc.callbacks.append(on_gc)

    def write_stats() -> None:
        while True:
            tmp = stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"handled": dict(handled), "generation": coord.generation, "rejected": coord.control.rejected,
                           "gc": dict(collections), "at": time.monotonic()}, f)
            os.replace(tmp, stats_path)
            time.sleep(0.5)

    threading.Thread(target=write_stats, daemon=True).start()
    if os.environ.get("FTRUN_BENCH_TIMINGS"):
        time_calls(os.environ["FTRUN_BENCH_TIMINGS"])
    conn.send(coord.control_addr)
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "bench-scale")
    profile_to = os.environ.get("FTRUN_BENCH_PROFILE")
    if profile_to:  # the main loop's profile, from the steady state's start to its end (SIGUSR2s)
        import cProfile

        profiler = cProfile.Profile()

        def toggle(_signum: int, _frame: Any) -> None:
            if profiler.getstats():
                profiler.disable()
                profiler.dump_stats(profile_to)
            else:
                profiler.enable()

        signal.signal(signal.SIGUSR2, toggle)
    coord.run()


#: What ``FTRUN_BENCH_TIMINGS`` times: the coordinator's round, its passes and its reading.
TIMED_CALLS = [("ftrun.coordinator.rounds", "RecoveryRounds", ["start", "send_order", "make_plan", "plan_when_reported",
                                                               "finish_when_recovered", "finish"]),
               ("ftrun.coordinator.failover", "Replication", ["replicate", "beat_ranks"]),
               ("ftrun.coordinator.failures", "Failures", ["node_lost", "check_hangs"]),
               ("ftrun.coordinator.core", "Coordinator", ["read_messages", "publish_status", "check_agents", "spawn"]),
               ("ftrun.coordinator.watchdog", "Watchdog", ["inspect"])]


def time_calls(path: str, at_least: float = 0.003) -> None:
    """Write a line to ``path`` for each call of :data:`TIMED_CALLS` that takes ``at_least``
    seconds or more: its start (wall), name, wall and CPU (its thread's) milliseconds."""
    import functools
    import importlib

    log = open(path, "w", buffering=1)

    def timed(owner: type, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.time(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if time.time() - t0 >= at_least:
                    log.write(f"{t0:.4f} {owner.__name__}.{name} wall {1e3 * (time.time() - t0):.1f} ms "
                              f"cpu {1e3 * (time.thread_time() - c0):.1f} ms\n")

        setattr(owner, name, wrapper)

    for module, cls, names in TIMED_CALLS:
        owner = getattr(importlib.import_module(module), cls)
        for name in names:
            timed(owner, name)


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def py_spy(pid: int, seconds: float) -> Any:
    """Start py-spy sampling process ``pid`` for ``seconds`` (200 a second, raw stacks) into
    ``FTRUN_BENCH_PYSPY``; returns its process."""
    import subprocess

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "200", "-f", "raw",
                             "-o", os.environ["FTRUN_BENCH_PYSPY"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def round_cpu_seconds(coord: int, sims: list[Any], cpu_at: float, sim_at: float, span: float,
                      steady: dict[str, Any]) -> dict[str, float]:
    """What a round cost in CPU, read from its start (``cpu_at``, ``sim_at``: the coordinator's
    and the simulation processes' CPU seconds then) to now, ``span`` seconds later: the
    coordinator's, the same less what its steady state costs in as long (its beats, passes and
    relayed heartbeats go on meanwhile), and the simulation's (every simulated rank and agent
    answering the round, on this machine's cores, not on thousands of hosts)."""
    cpu = proc_cpu_seconds(coord) - cpu_at
    return {"coordinator_cpu_s": round(cpu, 3),
            "coordinator_cpu_above_steady_s": round(cpu - steady.get("coordinator_cpu_pct", 0) / 100 * span, 3),
            "simulation_cpu_s": round(sum(proc_cpu_seconds(p.pid) for p in sims) - sim_at, 3),
            "measured_over_s": round(span, 3)}


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of each thread of process ``pid``, by thread name (summed over
    threads of one name), from /proc."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended meanwhile
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def proc_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid``, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- simulated ranks and agents
class Readiness:
    """Which of many ZeroMQ sockets have frames to read, in time proportional to the ready ones.

    ``zmq.Poller`` looks at every socket it holds at each call (a simulation process holds about
    3,700: its agents' and its ranks' connections to node 0); here each socket's ``ZMQ_FD`` (the
    eventfd of its command mailbox) sits in one level-triggered epoll. The fd is readable while
    commands wait, which a ``recv`` that ends in ``EAGAIN`` drains; a ``send`` may drain it too
    while frames wait, so :meth:`after_send` looks at the socket's ``ZMQ_EVENTS`` once sent on.
    """

    def __init__(self, zmq: Any) -> None:
        import select

        self.zmq, self.epoll = zmq, select.epoll()
        self.by_fd: dict[int, Any] = {}
        self.pending: set[Any] = set()  # sockets with frames known to wait (to read without waiting)

    def add(self, sock: Any) -> None:
        fd = sock.getsockopt(self.zmq.FD)
        self.by_fd[fd] = sock
        self.epoll.register(fd, 0x001)  # EPOLLIN, level-triggered
        self.pending.add(sock)  # a socket can be ready before its fd was watched

    def remove(self, sock: Any) -> None:
        fd = sock.getsockopt(self.zmq.FD)
        self.epoll.unregister(fd)
        self.by_fd.pop(fd, None)
        self.pending.discard(sock)

    def again(self, sock: Any) -> None:
        """``sock`` has frames left (read at the next :meth:`wait`, which then does not wait)."""
        self.pending.add(sock)

    def after_send(self, sock: Any) -> None:
        if sock.getsockopt(self.zmq.EVENTS) & self.zmq.POLLIN:
            self.pending.add(sock)

    def wait(self, timeout_ms: int) -> set[Any]:
        """The sockets that may have frames, waiting up to ``timeout_ms`` for one; read each until
        ``zmq.Again`` (or hand it back with :meth:`again`)."""
        events = self.epoll.poll(0 if self.pending else timeout_ms / 1000)
        ready, self.pending = self.pending, set()
        ready.update(self.by_fd[fd] for fd, _ in events if fd in self.by_fd)
        return ready


@dataclass
class Progress:
    """What :class:`ftrun.rank.client.StepBoard` reads of a rank's progress."""

    committed: int = -1
    current_step: int | None = None


@dataclass
class SimRank:
    rank: int
    incarnation: int
    node: "SimNode"
    sock: Any
    sender: Any
    receiver: Any
    board: Any
    progress: Progress
    alive: bool = True
    recovering: bool = False
    direct: int = 0  # frames sent to node 0 (a relayed beat carries the count)


@dataclass
class SimNode:
    index: int  # the node it serves (a standby's: STANDBY_NODE_INDEX until it takes a node)
    sock: Any  # its agent's DEALER (None for node 0: its agent is the coordinator's)
    sender: Any
    receiver: Any
    ranks: dict[int, SimRank] = field(default_factory=dict)
    silent: bool = False
    last_beat: float = 0.0  # when its agent last beat (wall)
    relayed: Any = None  # its agent's ftrun.node.relay.RelayedBeats (with --heartbeat_relay on; not node 0)
    record_addr: str = ""  # where its record store listens (ftrun.rank.rankstate)


@dataclass
class Counters:
    """What a simulation process sent to node 0 and received from it."""

    sent: dict[str, int] = field(default_factory=dict)
    sent_bytes: int = 0
    received: dict[str, int] = field(default_factory=dict)
    received_bytes: int = 0
    plans: dict[int, list[float]] = field(default_factory=dict)  # generation -> [first, last] receipt (wall)
    aborts: dict[int, list[float]] = field(default_factory=dict)
    hung_orders: int = 0  # kill_hung received: a rank taken for hung (the simulation fell behind)

    def note_sent(self, kind: str, nbytes: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        self.sent_bytes += nbytes

    def note_received(self, kind: str, nbytes: int) -> None:
        self.received[kind] = self.received.get(kind, 0) + 1
        self.received_bytes += nbytes


class Beats:
    """Sends due beats round-robin so that each of ``n`` senders beats once per ``interval``
    seconds, spread evenly over it (what independent ranks' heartbeat threads do)."""

    def __init__(self, interval: float, start: float) -> None:
        self.interval, self.start, self.done = interval, start, 0

    def due(self, n: int, now: float) -> int:
        """How many beats to send now (at most ``n``: a sender that fell behind sends one, not a burst)."""
        if n == 0:
            return 0
        target = int((now - self.start) / self.interval * n)
        count = max(0, min(target - self.done, n))
        self.done = max(self.done, target)  # a sender behind by more than an interval skips the beats it missed
        return count


class Simulation:
    """The agents and ranks of some nodes, in one process, on one thread.

    Args:
        nodes: the node indices this process simulates (:data:`STANDBY_NODE_INDEX`: the standby node).
        world, per_node: the job's ranks and ranks per node.
        control_addr: the coordinator's endpoint.
        interval: the heartbeat interval, seconds; ``step_s``: simulated step time.
    """

    def __init__(self, nodes: list[int], world: int, per_node: int, control_addr: str, interval: float,
                 step_s: float, relay: bool = False) -> None:
        import zmq

        from ftrun.common.protocol import FrameAuth

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.ctx.MAX_SOCKETS = 2 * SOCKETS_PER_PROCESS + 100  # (zmq.Context(io_threads=...) kept the default 1023)
        self.auth = FrameAuth(TOKEN)
        self.world, self.per_node, self.addr = world, per_node, control_addr
        self.nnodes = world // per_node
        self.interval, self.step_s, self.relay = interval, step_s, relay
        self.counters = Counters()
        # The record store of this process's nodes (ftrun.rank.rankstate; one for all of them), as
        # each node's fork server hosts one: its agents name it in their hello.
        from torch.distributed import TCPStore

        self.record_server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.record_port = self.record_server.port
        self.nodes: dict[int, SimNode] = {}
        self.by_sock: dict[Any, tuple[SimNode, SimRank | None]] = {}
        self.ready = Readiness(zmq)
        now = time.monotonic()
        # relayed ranks beat their agent twice an interval (ftrun.rank.channel); node 0's every other time
        self.rank_beats = Beats(interval, now)  # the ranks that beat node 0 themselves (beat)
        self.agent_beats = Beats(interval, now)
        self.rank_cursor = self.agent_cursor = 0
        self.ranks_list: list[SimRank] = []
        self.agents: list[SimNode] = []  # the nodes whose agents this process simulates (not node 0's)
        self._direct: list[SimRank] | None = None  # direct_ranks()
        self.step = 0
        self.next_step = now + step_s
        self.records: Any = None  # (store writers, steps left, next rank) while records are written
        for index in nodes:
            self.add_node(index)

    # ------------------------------------------------------------------ sockets and frames
    def _dealer(self, prefix: bytes) -> tuple[Any, Any, Any]:
        """A DEALER to node 0 (``prefix``: b"a" an agent's, b"r" a rank's)."""
        from ftrun.common.protocol import Receiver, Sender, to_peer

        zmq = self.zmq
        sock = self.ctx.socket(zmq.DEALER)
        identity = prefix + secrets.token_bytes(15)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.connect(self.addr)
        self.ready.add(sock)
        return sock, Sender(self.auth), Receiver(self.auth, to_peer(identity))

    def _send(self, sock: Any, sender: Any, msg_type: MsgType, r: SimRank | None = None, **fields: Any) -> None:
        """Send one frame to node 0 (``r``: the rank whose frame it is, which counts it)."""
        frame = encode(msg_type, sender, CONTROL, **fields)
        try:
            sock.send(frame, self.zmq.NOBLOCK)
        except self.zmq.Again:
            return
        finally:
            self.ready.after_send(sock)
        if r is not None:
            r.direct += 1
        self.counters.note_sent(msg_type._value_, len(frame))  # (the enum's ``value`` property: slower)

    def add_node(self, index: int) -> None:
        from ftrun.node.relay import RelayedBeats

        node = SimNode(index, None, None, None)
        # Two addresses for this process's nodes (even, odd) and one for the standby: a node's
        # buddy (the next node) has another, as on real hosts, with few connections to make.
        node.record_addr = f"127.1.0.{3 if index < 0 else 1 + index % 2}:{self.record_port}"
        if index != 0:
            node.relayed = RelayedBeats() if self.relay else None
            node.sock, node.sender, node.receiver = self._dealer(b"a")
            self.by_sock[node.sock] = (node, None)
            self.agents.append(node)
            self._send(node.sock, node.sender, MsgType.AGENT_HELLO, node=index, pid=SIM_PID_BASE // 2 + 1 + index,
                       host=f"sim-{index}", record_store=node.record_addr)
        self.nodes[index] = node
        if index == 0:  # node 0's ranks: its agent (the coordinator's) reported them spawned
            for rank in range(self.per_node):
                self.start_rank(node, rank, 0, 0)

    def start_rank(self, node: SimNode, rank: int, incarnation: int, generation: int) -> None:
        from ftrun.rank.client import StepBoard

        sock, sender, receiver = self._dealer(b"r")
        progress = Progress(committed=-1 if incarnation == 0 else -2)
        r = SimRank(rank, incarnation, node, sock, sender, receiver, StepBoard(progress), progress)
        node.ranks[rank] = r
        self.by_sock[sock] = (node, r)
        self.ranks_list.append(r)
        self._direct = None
        self._send(sock, sender, MsgType.HELLO, r, rank=rank, incarnation=incarnation, pid=sim_pid(rank, incarnation),
                   generation=generation, replica_group=replica_group(rank, self.world, self.per_node), library=True)
        if incarnation > 0:
            r.recovering = True

    def close_rank(self, r: SimRank) -> None:
        r.alive = False
        self.ready.remove(r.sock)
        self.by_sock.pop(r.sock, None)
        r.sock.close(0)
        self.ranks_list = [x for x in self.ranks_list if x is not r]
        self._direct = None

    # ------------------------------------------------------------------ what node 0 sends
    def receive(self, timeout_ms: int) -> None:
        from ftrun.common.protocol import ProtocolError, decode

        for sock in self.ready.wait(timeout_ms):
            owner = self.by_sock.get(sock)
            if owner is None:
                continue
            node, r = owner
            for _ in range(100):
                try:
                    frame = sock.recv(self.zmq.NOBLOCK)
                except self.zmq.Again:
                    break
                if node.silent:
                    continue  # a hung host reads nothing
                try:
                    msg = decode(frame, r.receiver if r is not None else node.receiver)
                except ProtocolError:
                    continue
                self.counters.note_received(msg.type._value_, len(frame))
                if r is None:
                    self.on_agent_order(node, msg)
                elif r.alive:
                    self.on_rank_order(r, msg.type, msg.fields, time.time())
            else:
                self.ready.again(sock)  # more than a pass's share: read on at the next pass

    def on_agent_order(self, node: SimNode, msg: Any) -> None:
        if msg.type == MsgType.TAKE_NODE:
            node.index = int(msg["node"])
        elif msg.type == MsgType.SPAWN:
            rank, incarnation = int(msg["rank"]), int(msg["incarnation"])
            self._send(node.sock, node.sender, MsgType.SPAWNED, node=node.index, rank=rank, incarnation=incarnation,
                       pid=sim_pid(rank, incarnation), spare=bool(msg["use_spare"]),
                       **({"spare_kind": "warm"} if msg["use_spare"] else {}))
            generation = int(dict(msg["vars"]).get(GENERATION, 0))
            self.start_rank(node, rank, incarnation, generation)
        elif msg.type == MsgType.STOP_RANKS:  # a whole-job restart: every rank of the node ends
            for r in [x for x in node.ranks.values() if x.alive]:
                self.report_exit(node, r, returncode=-signal.SIGTERM)
        elif msg.type == MsgType.STAND_BY:
            # The coordinator's standby: this agent offers a seat (never taken over here), so that the
            # coordinator beats every rank and replicates its state to it, as in a real job.
            self._send(node.sock, node.sender, MsgType.AGENT_BEAT, node=node.index,
                       standby_control=f"tcp://127.0.0.1:{STANDBY_SEAT_PORT}", standby_store="127.0.0.1:1")
        elif msg.type == MsgType.RANK_ORDERS:
            # A round's order, relayed: the agent hands it to each rank (a local hop on the rank's
            # own node, not simulated) and sends their answers in one frame (ftrun.node.relay).
            order, common, now = _ORDERS.get(msg["order"]), msg["common"], time.time()
            for rank, incarnation, own in msg["ranks"]:
                r = node.ranks.get(rank)
                if r is not None and r.alive and r.incarnation == incarnation:
                    self.on_rank_order(r, order, {**common, **own} if own else common, now, relayed=True)
            for rows in node.relayed.reports():
                self._send(node.sock, node.sender, MsgType.RANK_REPORTS, node=node.index, reports=rows)
        elif msg.type == MsgType.KILL_HUNG:
            self.counters.hung_orders += 1
            r = node.ranks.get(int(msg["rank"]))
            if r is not None and r.alive and r.incarnation == msg["incarnation"]:
                self.report_exit(node, r)

    def on_rank_order(self, r: SimRank, order: MsgType, msg: dict[str, Any], now: float, relayed: bool = False) -> None:
        """Rank ``r`` is sent a round's ``order`` (its fields ``msg``) at ``now`` (wall), and answers
        it: through its agent if the order came that way (a node's eight ranks a frame, twice a
        round: written for speed). The answer's fields are a rank's of the worker library
        (``ftrun.rank.client``: the abort's reason echoed, whether its loop can roll back; the
        plan's role, bytes, transfer and rebuild seconds)."""
        if order is MsgType.ABORT:
            generation, seen = msg["generation"], self.counters.aborts
            r.recovering = True
            r.board.enter("recovering")
            step = r.progress.current_step
            answer = MsgType.FAULT
            fields = {"rank": r.rank, "incarnation": r.incarnation, "generation": generation,
                      "step": step if step is not None else -1, "committed": r.progress.committed,
                      "reason": msg["reason"], "kind": "abort", "rollback": True}
        elif order is MsgType.RECONFIGURE:
            generation, seen = msg["generation"], self.counters.plans
            transfers = msg["transfers"]
            role = ("recipient" if any(t[1] == r.rank for t in transfers)
                    else "donor" if any(t[0] == r.rank for t in transfers) else "none")
            r.progress.committed = msg["step"]
            r.recovering = False
            r.board.enter("compute")
            answer = MsgType.RECOVERED
            fields = {"rank": r.rank, "incarnation": r.incarnation, "generation": generation, "role": role,
                      "bytes": RECORD_BYTES if role == "recipient" else 0, "seconds": 0.0, "rebuild_seconds": 0.0}
        else:
            return
        times = seen.get(generation)
        if times is None:
            seen[generation] = [now, now]
        else:
            times[1] = now
        if relayed:
            r.node.relayed.note_answer(answer, fields)
        else:
            self._send(r.sock, r.sender, answer, r, **fields)

    def report_exit(self, node: SimNode, r: SimRank, returncode: int = -9) -> float:
        """``r`` dies: its agent reports the exit (the ``SIGCHLD``'s time); returns that time (wall)."""
        at = time.time()
        self.close_rank(r)
        self._send(node.sock, node.sender, MsgType.EXITED, node=node.index, rank=r.rank, incarnation=r.incarnation,
                   pid=sim_pid(r.rank, r.incarnation), returncode=returncode, at=at)
        return at

    # ------------------------------------------------------------------ what the ranks and agents send
    def beat(self, now: float) -> None:
        """Send the beats due: the agents' first (a simulation process that falls behind must not
        pass its own lag off as a node's silence), then the heartbeats, with their step boards, of
        the ranks that beat node 0 themselves (node 0's; every rank's without the relay).

        With the relay, a rank of a node other than 0 beats its agent twice an interval
        (``ftrun.rank.channel``) and the agent's beat carries the newer of the two: the simulation
        makes only that one, right before its agent's beat, so what node 0 receives is the same
        (the rows' ages are smaller) for half the simulation's work (other machines' in a job)."""
        agents = self.agents
        for _ in range(self.agent_beats.due(len(agents), now)):
            self.agent_cursor %= len(agents)
            node = agents[self.agent_cursor]
            self.agent_cursor += 1
            if node.silent:
                continue
            rows = []
            if node.relayed is not None:
                for r in node.ranks.values():
                    if r.alive:
                        node.relayed.note({**self.beat_fields(r), "sent": r.direct}, now)
                rows = node.relayed.rows(now)
            self._send(node.sock, node.sender, MsgType.AGENT_BEAT, node=node.index, **({"ranks": rows} if rows else {}))
            node.last_beat = time.time()
        direct = self.direct_ranks()
        for _ in range(self.rank_beats.due(len(direct), now)):
            self.rank_cursor %= len(direct)
            r = direct[self.rank_cursor]
            self.rank_cursor += 1
            if not r.node.silent:
                self._send(r.sock, r.sender, MsgType.HEARTBEAT, **self.beat_fields(r))

    @staticmethod
    def beat_fields(r: SimRank) -> dict[str, Any]:
        return dict(rank=r.rank, incarnation=r.incarnation, **r.board.fields(), in_dist=False,
                    stage="recover" if r.recovering else "loop", stage_bytes=0)

    def direct_ranks(self) -> list[SimRank]:
        """The ranks that beat node 0 themselves (made again when a rank starts or ends)."""
        if self._direct is None:
            self._direct = [r for r in self.ranks_list if r.node.relayed is None]
        return self._direct

    def advance(self, now: float) -> None:
        """Every rank not recovering begins the next step (having committed the one before)."""
        if now < self.next_step:
            return
        self.next_step = max(self.next_step + self.step_s, now)
        self.step += 1
        for r in self.ranks_list:
            if not r.recovering and not r.node.silent:
                if r.progress.current_step is not None:
                    r.progress.committed = r.progress.current_step
                r.progress.current_step = max(self.step, r.progress.committed + 1)
                r.board.begin(r.progress.current_step, None)

    # ------------------------------------------------------------------ rank-state records
    def start_records(self, store_port: int, steps: int, record_bytes: int, where: str) -> None:
        """Write ``steps`` steps of every live rank's records (a chunk of ranks per loop pass, so
        the heartbeats go on meanwhile). ``where``: ``node``, as ranks of a multi-node job do (to
        their node's record store and a copy at their buddy's, found through the job's store by
        :func:`ftrun.rank.rankstate.record_stores`; this process's one store stands for the record
        stores of all its nodes), or ``job``, the design before it (every record into the job's store)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        from ftrun.common.contract import RECORD_STORE
        from ftrun.rank.rankstate import RankStateStore, record_stores

        clients: dict[str, Any] = {}
        into: dict[int, list[int]] = {}  # node -> [writes, bytes] into its record store
        live = [r for r in self.ranks_list if r.alive and not r.node.silent]
        self.records = rec = {"clients": clients, "into": into, "writers": None, "blob": os.urandom(record_bytes),
                              "steps": steps, "step": 0, "next": 0, "started": None, "finished": None}

        def connect(addr: str, timeout_s: float) -> Any:
            if addr not in clients:
                host, _, port = addr.rpartition(":")
                clients[addr] = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
            return clients[addr]

        def open_stores() -> None:
            # On a thread of its own (a store call lets go of the GIL): a new connection to a store
            # waits for a look-up of the client's host name, and this machine's resolver drops one
            # query in 25, which holds that connection 5 s; the heartbeats go on meanwhile.
            started = time.monotonic()
            job = rec["job"] = CountingStore(TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60)))
            writers = []
            for r in live:
                if where == "job":
                    writers.append((r, RankStateStore(job, 0, r.rank)))
                    continue
                env = {RECORD_STORE: r.node.record_addr, "GROUP_RANK": str(r.node.index), "GROUP_WORLD_SIZE": str(self.nnodes)}
                store, copies, _ = record_stores(job, 60.0, env, connect)
                buddy = (r.node.index + 1) % self.nnodes
                writers.append((r, RankStateStore(NodeCounting(store, into.setdefault(r.node.index, [0, 0])), 0, r.rank,
                                                  [NodeCounting(c, into.setdefault(buddy, [0, 0])) for c in copies])))
            rec["lookups"] = {"ops": job.ops + job.reads, "seconds": time.monotonic() - started}
            job.ops = job.nbytes = job.reads = 0  # from here: what the steps send to the job's store
            rec["started"] = time.monotonic()
            rec["writers"] = writers

        threading.Thread(target=open_stores, daemon=True).start()

    def write_records(self, chunk: int = 256) -> None:
        rec = self.records
        if rec is None or rec["finished"] is not None or rec["writers"] is None:
            return
        writers = rec["writers"]
        label = 1000 + rec["step"]
        for r, writer in writers[rec["next"]:rec["next"] + chunk]:
            # A step's writes (ftrun.rank.rankstate): the provisional record at the backward pass, the
            # local gradient's digest, the next step start's record (equal to the provisional one:
            # not written).
            writer.put_encoded(label, rec["blob"], provisional=True)
            writer.put_gradient_digest(label, "0" * 64)
            writer.put_encoded(label, rec["blob"], mid_pass=True)
        rec["next"] += chunk
        if rec["next"] >= len(writers):
            rec["next"], rec["step"] = 0, rec["step"] + 1
            if rec["step"] >= rec["steps"]:
                for store in [rec["job"].store, *rec["clients"].values()]:
                    store.check(["ftrun/bench/flush"])  # a set does not wait: one read, once every write is taken
                rec["finished"] = time.monotonic()

    def records_report(self) -> dict[str, Any] | None:
        rec = self.records
        if rec is None or rec["writers"] is None:
            return None
        job = rec["job"]
        return {"job_ops": job.ops, "job_bytes": job.nbytes, "into": {str(n): v for n, v in rec["into"].items()},
                "steps": rec["steps"], "ranks": len(rec["writers"]), "lookups": rec["lookups"],
                "seconds": (rec["finished"] or time.monotonic()) - rec["started"], "done": rec["finished"] is not None}

    # ------------------------------------------------------------------ driver's commands
    def command(self, cmd: str, arg: Any) -> Any:
        if cmd == "counters":
            return {**dataclasses.asdict(self.counters), "ranks": len(self.ranks_list), "records": self.records_report()}
        if cmd == "kill":
            for node in self.nodes.values():
                r = node.ranks.get(arg)
                if r is not None and r.alive:
                    return self.report_exit(node, r)
            return None
        if cmd == "silence":
            node = self.nodes.get(arg)
            if node is None:
                return None
            node.silent = True
            return node.last_beat or time.time()
        if cmd == "records":
            self.start_records(*arg)
            return True
        if cmd == "publish_node0":
            # Node 0's record store, published as its coordinator does (from its own environment)
            if 0 in self.nodes:
                from datetime import timedelta

                from torch.distributed import TCPStore

                from ftrun.common.contract import record_store_key

                TCPStore("127.0.0.1", arg, is_master=False, timeout=timedelta(seconds=60)).set(
                    record_store_key(0), self.nodes[0].record_addr)
            return True
        raise ValueError(cmd)

    def run(self, conn: Any) -> None:
        import gc

        frozen_at = 0.0
        while True:
            now = time.monotonic()
            if now - frozen_at > 5.0:
                # What this process simulates is thousands of small processes' state: the cyclic
                # collector's full passes over it (tens of ms) would be pauses no real agent has.
                gc.freeze()
                frozen_at = now
            if conn.poll():
                cmd, arg = conn.recv()
                if cmd == "stop":
                    break
                conn.send(self.command(cmd, arg))
            self.advance(now)
            self.beat(now)
            self.write_records()
            self.receive(timeout_ms=5)
        for sock in list(self.by_sock):
            sock.close(0)
        self.ctx.term()


class CountingStore:
    """A store client that counts its writes (operations and value bytes) and reads, and passes them on."""

    def __init__(self, store: Any) -> None:
        self.store, self.ops, self.nbytes, self.reads = store, 0, 0, 0

    def set(self, key: str, value: bytes) -> None:
        self.ops += 1
        self.nbytes += len(value) + len(key)
        self.store.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.reads += 1
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return self.store.get(key)


class NodeCounting:
    """A record store client that counts the writes meant for one node's record store into
    ``counts`` ([writes, bytes]): this process's one store stands for the stores of its nodes."""

    def __init__(self, store: Any, counts: list[int]) -> None:
        self.store, self.counts = store, counts

    def set(self, key: str, value: bytes) -> None:
        self.counts[0] += 1
        self.counts[1] += len(value) + len(key)
        self.store.set(key, value)


def simulation_main(conn: Any, nodes: list[int], world: int, per_node: int, control_addr: str, interval: float,
                    step_s: float, nice: int = 0, relay: bool = False, sched: str = "batch") -> None:
    import torch.distributed  # noqa: F401  (the store client's; imported before any beat: it takes seconds)

    if nice:
        os.nice(nice)  # the simulated nodes are other machines: node 0's processes go first here
    simulation_scheduling(sched)  # before its ZeroMQ I/O thread starts, which takes the same

    Simulation(nodes, world, per_node, control_addr, interval, step_s, relay).run(conn)


def simulation_scheduling(policy: str) -> None:
    """Put the calling process (and the threads it starts from now on) under ``policy``: ``batch``
    is Linux's ``SCHED_BATCH``, whose wake-ups do not preempt a running process (its share of the
    CPU is a nice-0 process's); ``other`` leaves the default. The simulation processes stand for
    2,047 other machines: on node 0's two cores here, each frame node 0 sends woke a simulation
    process that preempted node 0's coordinator in the middle of its work (a round's abort sent to
    2,048 agents took 65 ms for 32 ms of CPU), which no other machine does; under ``batch`` the
    one-node round at 16,384 ranks was 0.43-0.47 s where it was 0.50-0.55 s, in runs one after
    the other (docs/scale.md). Where ``SCHED_BATCH`` is unknown (not Linux), nothing changes."""
    if policy == "batch" and hasattr(os, "SCHED_BATCH"):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


# --------------------------------------------------------------------------- the driver
class EventTail:
    """The coordinator's events.jsonl, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.events = path, 0, []

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1
            self.offset += cut
            for line in data[:cut].splitlines():
                self.events.append(json.loads(line))
        return self.events

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.read() if e["kind"] == kind]


class Incomplete(Exception):
    """A phase did not finish within the size's time cap."""


@dataclass
class SizeRun:
    """One size's processes and measurements."""

    ranks: int
    per_node: int
    deadline: float
    result: dict[str, Any] = field(default_factory=dict)
    procs: list[Any] = field(default_factory=list)  # the store's, the coordinator's, the simulations'

    def wait(self, what: str, done: Callable[[], Any], poll: float = 0.1) -> Any:
        """Poll ``done()`` until it returns something true, and return that.

        Raises:
            Incomplete: the size's cap passed first, or one of its processes died.
        """
        while True:
            got = done()
            if got:
                return got
            if time.monotonic() > self.deadline:
                raise Incomplete(f"{what}: not finished within the size's cap")
            dead = [p.name for p in self.procs if not p.is_alive()]
            if dead:
                raise Incomplete(f"{what}: process {', '.join(dead)} died")
            time.sleep(poll)


def receive(conn: Any, what: str, timeout: float = 120.0) -> Any:
    """The next object from a child process's pipe.

    Raises:
        RuntimeError: nothing came within ``timeout`` seconds (the child failed: its traceback is on stderr).
    """
    if not conn.poll(timeout):
        raise RuntimeError(f"{what} did not come within {timeout:g} s")
    return conn.recv()


def ask_all(pipes: list[Any], cmd: str, arg: Any = None) -> list[Any]:
    for conn in pipes:
        conn.send((cmd, arg))
    return [receive(conn, f"the answer to {cmd}") for conn in pipes]


def sum_counters(reports: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"sent": {}, "sent_bytes": 0, "received": {}, "received_bytes": 0, "hung_orders": 0,
                           "plans": {}, "aborts": {}}
    for rep in reports:
        for key in ("sent", "received"):
            for kind, n in rep[key].items():
                out[key][kind] = out[key].get(kind, 0) + n
        for key in ("sent_bytes", "received_bytes", "hung_orders"):
            out[key] += rep[key]
        for key in ("plans", "aborts"):
            for gen, (first, last) in rep[key].items():
                have = out[key].get(int(gen))
                out[key][int(gen)] = [min(first, have[0]), max(last, have[1])] if have else [first, last]
    return out


def round_phases(events: "EventTail", run: "SizeRun", pipes: list[Any], at: float, fin: dict[str, Any]) -> dict[str, float]:
    """A recovery round's phases, seconds from ``at`` (wall: the death, or the node's verdict) to
    its start, the abort at every rank, the plan made and at every rank, and its end (``fin``: its
    ``recovery_finished`` event)."""
    planned = events.of("recovery_planned")[-1]
    gen = planned["generation"]
    plans = run.wait("plan receipts", lambda: sum_counters(ask_all(pipes, "counters"))["plans"].get(gen))
    aborts = sum_counters(ask_all(pipes, "counters"))["aborts"].get(gen) or [at, at]
    return {"to_round_started_s": round(events.of("recovery_started")[-1]["time"] - at, 4),
            "to_abort_received_by_all_s": round(aborts[1] - at, 4),
            "to_plan_decided_s": round(planned["time"] - at, 4),
            "to_plan_received_by_all_s": round(plans[1] - at, 4),
            "round_s": round(fin["time"] - at, 4)}


def measure_size(ranks: int, per_node: int, window: float, cap: float, store_steps: int, record_bytes: int,
                 interval: float, step_s: float, heartbeat_timeout: float = 5.0,
                 say: Callable[[str], None] = print, sim_nice: int = 0, sim_sched: str = "batch", relay: bool = True,
                 record_stores: str = "node") -> dict[str, Any]:
    """Run one size through the phases (module docstring); returns its figures (``incomplete``
    names the phase that did not finish within ``cap`` seconds)."""
    mp = multiprocessing.get_context("fork")
    tmp = Path(tempfile.mkdtemp(prefix="ftrun-scale-"))
    run = SizeRun(ranks, per_node, time.monotonic() + cap)
    res = run.result
    res.update(ranks=ranks, nodes=ranks // per_node, per_node=per_node, heartbeat_interval_s=interval, step_s=step_s,
               sim_nice=sim_nice, sim_sched=sim_sched, heartbeat_relay="on" if relay else "off")
    procs: list[Any] = run.procs
    pipes: list[Any] = []
    events: EventTail | None = None
    t_begin = time.monotonic()
    try:
        parent, child = mp.Pipe()
        store = mp.Process(target=store_main, args=(child,), daemon=True, name="store")
        store.start()
        procs.append(store)
        store_port = receive(parent, "the store's port")
        stats = tmp / "coordinator_stats.json"
        parent, child = mp.Pipe()
        coord = mp.Process(target=coordinator_main, args=(child, ranks, per_node, store_port, str(tmp), str(stats), interval,
                                                             heartbeat_timeout),
                           daemon=True, name="coordinator")
        coord.start()
        procs.append(coord)
        control_addr = receive(parent, "the coordinator's endpoint")
        events = EventTail(tmp / "events.jsonl")

        def coordinator_stats() -> dict[str, Any]:
            try:
                return json.loads(stats.read_text())
            except (OSError, ValueError):
                return {}

        def handled() -> dict[str, int]:
            return coordinator_stats().get("handled", {})

        layout = plan_processes(ranks // per_node, per_node)
        where: dict[int, int] = {}  # node -> index of its simulation process
        for i, nodes in enumerate(layout):
            parent, child = mp.Pipe()
            sim = mp.Process(target=simulation_main,
                             args=(child, nodes, ranks, per_node, control_addr, interval, step_s, sim_nice, relay,
                                   sim_sched),
                             daemon=True, name=f"simulation-{i}")
            sim.start()
            procs.append(sim)
            pipes.append(parent)
            where.update({n: i for n in nodes})
        res["simulation_processes"] = len(layout)

        # 1. start (within half the cap: the steady state is measured even if it is not over)
        t0 = time.monotonic()
        try:
            SizeRun(ranks, per_node, time.monotonic() + cap / 2, procs=procs).wait(
                "start (every rank's hello)", lambda: handled().get("hello", 0) >= ranks)
            res["start_s"] = round(time.monotonic() - t0, 2)
            say(f"  {ranks} ranks: every hello handled in {res['start_s']} s")
        except Incomplete:
            res["start_incomplete"] = f"{handled().get('hello', 0)} of {ranks} hellos handled in {time.monotonic() - t0:.0f} s"
            say(f"  {ranks} ranks: start not over: {res['start_incomplete']}; measuring the steady state all the same")

        # 2. steady state: from when the coordinator has caught up with the start (two seconds, by
        # its own clock, in which it handled no more than 20% above what arrives), at most a quarter
        # of the cap after it
        due = ((per_node if relay else ranks) + ranks // per_node) / interval
        t_settle, settle_by = time.monotonic(), time.monotonic() + cap / 4
        time.sleep(min(3.0, window / 2))
        first = coordinator_stats()
        while time.monotonic() < settle_by:
            time.sleep(2.0)
            last = coordinator_stats()
            span = last.get("at", 0.0) - first.get("at", 0.0)
            moved = sum(last.get("handled", {}).values()) - sum(first.get("handled", {}).values())
            if "at" in first and span >= 1.5 and moved <= 1.2 * due * span:
                break
            first = last if span >= 1.5 else first
        res["settle_s"] = round(time.monotonic() - t_settle, 2)
        profiled = (os.environ.get("FTRUN_BENCH_PROFILE_PHASE", "steady")
                    if os.environ.get("FTRUN_BENCH_PROFILE") or os.environ.get("FTRUN_BENCH_PYSPY") else None)
        profiling = profiled == "steady" and bool(os.environ.get("FTRUN_BENCH_PROFILE"))
        if profiling:
            os.kill(coord.pid, signal.SIGUSR2)
        spy = py_spy(coord.pid, window) if os.environ.get("FTRUN_BENCH_PYSPY") and profiled in (None, "steady") else None
        sims = procs[2:]
        threads0, gc0 = thread_cpu_seconds(coord.pid), coordinator_stats().get("gc", {})
        cpu0, h0, c0, w0 = proc_cpu_seconds(coord.pid), handled(), sum_counters(ask_all(pipes, "counters")), time.monotonic()
        sim_cpu0 = sum(proc_cpu_seconds(p.pid) for p in sims)
        time.sleep(window)
        reports = ask_all(pipes, "counters")
        cpu1, h1, c1, w1 = proc_cpu_seconds(coord.pid), handled(), sum_counters(reports), time.monotonic()
        threads1, gc1 = thread_cpu_seconds(coord.pid), coordinator_stats().get("gc", {})
        sim_cpu1 = sum(proc_cpu_seconds(p.pid) for p in sims)
        started = sum(rep["ranks"] for rep in reports)  # rank processes the simulation runs now
        if profiling:
            os.kill(coord.pid, signal.SIGUSR2)
        if spy is not None:
            spy.wait()
        span = w1 - w0
        sent = sum(c1["sent"].values()) - sum(c0["sent"].values())
        done = sum(h1.values()) - sum(h0.values())
        res["steady"] = {
            "window_s": round(span, 2),
            "coordinator_cpu_pct": round(100 * (cpu1 - cpu0) / span, 1),
            # by thread: the main loop's (python), ZeroMQ's I/O thread, the status writer...
            # the cyclic garbage collector in the coordinator's main loop (a share of the python thread's)
            "coordinator_gc_pct": round(100 * (gc1.get("seconds", 0) - gc0.get("seconds", 0)) / span, 1),
            "coordinator_gc_passes": gc1.get("count", 0) - gc0.get("count", 0),
            "coordinator_threads_cpu_pct": {name: round(100 * (cpu - threads0.get(name, 0.0)) / span, 1)
                                            for name, cpu in threads1.items() if cpu - threads0.get(name, 0.0) > 0},
            # what simulating every other node costs this machine meanwhile (its cores are shared)
            "simulation_cpu_pct": round(100 * (sim_cpu1 - sim_cpu0) / span, 1),
            "msgs_in_per_s": round(sent / span, 1),
            "bytes_in_per_s": round((c1["sent_bytes"] - c0["sent_bytes"]) / span),
            "msgs_handled_per_s": round(done / span, 1),
            # The CPU a handled message cost, whatever share of the cores the process got (a loaded
            # machine gives it less than it needs: then it handles fewer than arrive, and the rest waits).
            "cpu_us_per_msg_handled": round(1e6 * (cpu1 - cpu0) / max(done, 1), 1),
            "cpu_pct_needed": round(100 * (cpu1 - cpu0) / max(done, 1) * sent / span, 1),
            "msgs_out_per_s": round((sum(c1["received"].values()) - sum(c0["received"].values())) / span, 1),
            "bytes_out_per_s": round((c1["received_bytes"] - c0["received_bytes"]) / span),
            "heartbeats_per_s": round((c1["sent"].get("heartbeat", 0) - c0["sent"].get("heartbeat", 0)) / span, 1),
            # what the started ranks and every agent owe a second: more than msgs_in_per_s when the
            # simulation itself falls behind
            # (with the relay: node 0's ranks and the agents, whose beats carry the other ranks')
            "frames_due_per_s": round(((per_node if relay else started) + ranks // per_node) / interval, 1),
            "coordinator_rss_bytes": proc_rss_bytes(coord.pid),
        }
        say(f"  steady: coordinator {res['steady']['coordinator_cpu_pct']}% of a core, "
            f"{res['steady']['msgs_in_per_s']:.0f} msgs/s in, {res['steady']['bytes_in_per_s'] / 1e6:.2f} MB/s in")

        # 3. a rank's death
        victim = per_node + 3  # a rank of node 1
        n_finished = len(events.of("recovery_finished"))
        spy = py_spy(coord.pid, 3) if os.environ.get("FTRUN_BENCH_PYSPY") and profiled == "round" else None
        if profiled == "round" and os.environ.get("FTRUN_BENCH_PROFILE"):
            os.kill(coord.pid, signal.SIGUSR2)
        cpu_at, sim_at = proc_cpu_seconds(coord.pid), sum(proc_cpu_seconds(p.pid) for p in sims)
        at = ask_all([pipes[where[1]]], "kill", victim)[0]
        fin = run.wait("one rank's recovery", lambda: events.of("recovery_finished")[n_finished:])[0]
        round_cpu = round_cpu_seconds(coord.pid, sims, cpu_at, sim_at, time.time() - at, res["steady"])
        if profiled == "round" and os.environ.get("FTRUN_BENCH_PROFILE"):
            os.kill(coord.pid, signal.SIGUSR2)
        if spy is not None:
            spy.wait()
        res["rank_death"] = {
            **round_phases(events, run, pipes, at, fin),
            "coordinator_total_seconds": fin["detail"]["total_seconds"],
            **round_cpu,
        }
        say(f"  rank death: plan decided {res['rank_death']['to_plan_decided_s']} s, received by all "
            f"{res['rank_death']['to_plan_received_by_all_s']} s, round {res['rank_death']['round_s']} s")

        # 4. a node's silence
        silent_node = ranks // per_node - 1
        n_lost, n_finished = len(events.of("node_lost")), len(events.of("recovery_finished"))
        silent_at = ask_all([pipes[where[silent_node]]], "silence", silent_node)[0]
        lost = run.wait("node verdict", lambda: events.of("node_lost")[n_lost:], poll=0.02)[0]
        cpu_at, sim_at, lost_seen = proc_cpu_seconds(coord.pid), sum(proc_cpu_seconds(p.pid) for p in sims), time.time()
        spy = py_spy(coord.pid, 2) if os.environ.get("FTRUN_BENCH_PYSPY") and profiled == "node" else None
        fin = run.wait("one node's recovery", lambda: events.of("recovery_finished")[n_finished:])[0]
        if spy is not None:
            spy.wait()
        round_cpu = round_cpu_seconds(coord.pid, sims, cpu_at, sim_at, time.time() - lost_seen, res["steady"])
        timeout = max(heartbeat_timeout, 3 * interval)  # ftrun.coordinator.failover.silence_timeout
        res["node_silence"] = {
            "silence_timeout_s": timeout,
            "to_verdict_s": round(lost["time"] - silent_at, 3),
            "verdict_after_timeout_s": round(lost["time"] - silent_at - timeout, 3),
            **round_phases(events, run, pipes, lost["time"], fin),  # from the verdict
            **round_cpu,
        }
        say(f"  node silence: verdict after {res['node_silence']['to_verdict_s']} s "
            f"(timeout {timeout:g} s), round {res['node_silence']['round_s']} s")

        # 5. rank-state records
        if store_steps > 0:
            ask_all(pipes, "publish_node0", store_port)
            store_cpu0 = proc_cpu_seconds(store.pid)  # the buddies' look-ups included
            ask_all(pipes, "records", (store_port, store_steps, record_bytes, record_stores))

            def records() -> list[dict[str, Any]] | None:
                reps = [rep["records"] for rep in ask_all(pipes, "counters")]
                return reps if all(rep and rep["done"] for rep in reps) else None

            reps = run.wait("rank-state records", records, poll=0.2)
            seconds = max(r["seconds"] for r in reps)  # from the look-ups' end to the last write taken
            ops, nbytes = sum(r["job_ops"] for r in reps), sum(r["job_bytes"] for r in reps)
            into: dict[str, list[int]] = {}
            for rep in reps:
                for node, (writes, nb) in rep["into"].items():
                    into.setdefault(node, [0, 0])
                    into[node][0] += writes
                    into[node][1] += nb
            per_node = sorted(nb for _, nb in into.values())
            res["store"] = {
                "record_stores": record_stores,
                "steps": store_steps,
                # into node 0's job store (the launcher's TCPStore) by the steps' writes
                "ops_per_step": round(ops / store_steps),
                "bytes_per_step": round(nbytes / store_steps),
                # into each node's record store (its own ranks' records and its buddy's copies)
                "node0_record_store_bytes_per_step": round(into.get("0", [0, 0])[1] / store_steps),
                "node_record_store_bytes_per_step_max": round(per_node[-1] / store_steps) if per_node else 0,
                "node_record_store_bytes_per_step_median": round(per_node[len(per_node) // 2] / store_steps) if per_node else 0,
                # once per generation and rank: its buddy's address, read from the job's store
                "lookup_ops": sum(r["lookups"]["ops"] for r in reps),
                "lookup_s_max": round(max(r["lookups"]["seconds"] for r in reps), 3),
                "seconds_per_step": round(seconds / store_steps, 3),
                "store_cpu_s_per_step": round((proc_cpu_seconds(store.pid) - store_cpu0) / store_steps, 3),
                "store_rss_bytes": proc_rss_bytes(store.pid),
            }
            say(f"  records ({record_stores} stores): {res['store']['ops_per_step']} ops and "
                f"{res['store']['bytes_per_step'] / 1e6:.1f} MB a step into node 0's job store; "
                f"{res['store']['node0_record_store_bytes_per_step'] / 1e6:.2f} MB a step into node 0's record store "
                f"(the most into one node's: {res['store']['node_record_store_bytes_per_step_max'] / 1e6:.2f} MB); "
                f"{res['store']['seconds_per_step']} s a step")
    except (Incomplete, OSError, EOFError, RuntimeError) as err:  # a phase not over in time, or a process gone
        res["incomplete"] = str(err) if isinstance(err, Incomplete) else f"{type(err).__name__}: {err}"
        if len(procs) > 1 and procs[1].is_alive():
            os.kill(procs[1].pid, signal.SIGUSR1)  # the coordinator's stacks, on stderr
            time.sleep(1.0)
        res["cap_s"] = cap
        say(f"  {ranks} ranks: INCOMPLETE: {res['incomplete']}")
    finally:
        try:
            if len(procs) > 1 and procs[1].is_alive():
                res["coordinator_rss_bytes"] = proc_rss_bytes(procs[1].pid)
                res["rejected_frames"] = coordinator_stats().get("rejected", 0)
            if pipes and all(p.is_alive() for p in procs):
                # kill_hung orders: ranks the coordinator took for hung (heartbeats it read too late)
                res["hung_orders"] = sum_counters(ask_all(pipes, "counters"))["hung_orders"]
        except (OSError, RuntimeError, EOFError):
            pass
        if events is not None:  # what the coordinator decided meanwhile (a false node loss or hang shows here)
            kinds: dict[str, int] = {}
            for e in events.read():
                kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
            res["events"] = {k: n for k, n in sorted(kinds.items()) if k not in ("rank_joined", "rank_started")}
        for conn in pipes:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for proc in reversed(procs):
            proc.join(timeout=5 if proc in procs[2:] else 0)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)
        if os.environ.get("FTRUN_BENCH_KEEP"):
            say(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    res["wall_s"] = round(time.monotonic() - t_begin, 1)
    return res


# --------------------------------------------------------------------------- report
COLUMNS = [
    ("ranks", lambda r: r["ranks"], "{}"),
    ("coord CPU %", lambda r: r.get("steady", {}).get("coordinator_cpu_pct"), "{}"),
    ("msgs/s in", lambda r: r.get("steady", {}).get("msgs_in_per_s"), "{:.0f}"),
    ("MB/s in", lambda r: _div(r.get("steady", {}).get("bytes_in_per_s"), 1e6), "{:.2f}"),
    ("handled/s", lambda r: r.get("steady", {}).get("msgs_handled_per_s"), "{:.0f}"),
    ("us/msg", lambda r: r.get("steady", {}).get("cpu_us_per_msg_handled"), "{}"),
    ("% needed", lambda r: r.get("steady", {}).get("cpu_pct_needed"), "{}"),
    ("job store ops/step", lambda r: r.get("store", {}).get("ops_per_step"), "{}"),
    ("job store MB/step", lambda r: _div(r.get("store", {}).get("bytes_per_step"), 1e6), "{:.1f}"),
    ("node 0 record store MB/step", lambda r: _div(r.get("store", {}).get("node0_record_store_bytes_per_step"), 1e6), "{:.2f}"),
    ("death->plan s", lambda r: r.get("rank_death", {}).get("to_plan_received_by_all_s"), "{}"),
    ("rank round s", lambda r: r.get("rank_death", {}).get("round_s"), "{}"),
    ("silence->verdict s", lambda r: r.get("node_silence", {}).get("to_verdict_s"), "{}"),
    ("node round s", lambda r: r.get("node_silence", {}).get("round_s"), "{}"),
    ("coord RSS MB", lambda r: _div(r.get("coordinator_rss_bytes"), 1e6), "{:.0f}"),
]


def _div(value: float | None, by: float) -> float | None:
    return None if value is None else value / by


def table(results: list[dict[str, Any]]) -> str:
    """The results as a fixed-width table (``-``: not measured)."""
    head = [name for name, _, _ in COLUMNS]
    rows = [[("-" if (v := get(r)) is None else fmt.format(v)) for _, get, fmt in COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"{r['ranks']} ranks: {r['incomplete']}" for r in results if "incomplete" in r]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], target: Path) -> None:
    """Draw each cost against the ranks (log-log) into ``target`` (PNG); points not measured are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("node 0's coordinator, % of one core", [
            ("steady state, measured", lambda r: r.get("steady", {}).get("coordinator_cpu_pct")),
            ("needed for every message (CPU per message x arrivals)", lambda r: r.get("steady", {}).get("cpu_pct_needed"))]),
        ("into node 0, per second / per step", [
            ("control messages /s", lambda r: r.get("steady", {}).get("msgs_in_per_s")),
            ("control KB /s", lambda r: _div(r.get("steady", {}).get("bytes_in_per_s"), 1e3)),
            ("job store MB / step", lambda r: _div(r.get("store", {}).get("bytes_per_step"), 1e6)),
            ("node 0's record store MB / step", lambda r: _div(r.get("store", {}).get("node0_record_store_bytes_per_step"), 1e6))]),
        ("control-plane time, s", [
            ("rank death -> plan at every rank", lambda r: r.get("rank_death", {}).get("to_plan_received_by_all_s")),
            ("one-rank round", lambda r: r.get("rank_death", {}).get("round_s")),
            ("one-node round", lambda r: r.get("node_silence", {}).get("round_s")),
            ("node silence -> verdict, past the timeout", lambda r: r.get("node_silence", {}).get("verdict_after_timeout_s"))]),
        ("node 0's memory, MB", [("coordinator RSS", lambda r: _div(r.get("coordinator_rss_bytes"), 1e6)),
                                 ("store RSS", lambda r: _div(r.get("store", {}).get("store_rss_bytes"), 1e6))]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (title, series) in zip(axes.flat, panels):
        for label, get in series:
            points = [(r["ranks"], v) for r in results if (v := get(r)) is not None and v > 0]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (8 a node)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ftrun's control plane at node 0, simulated ranks (scripts/bench_scale.py)", fontsize=11)
    fig.tight_layout()
    fig.savefig(target, dpi=90)
    plt.close(fig)


def machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="256,1024,4096,16384", help="comma-separated job sizes (ranks)")
    p.add_argument("--per_node", type=int, default=PER_NODE, help="ranks per node")
    p.add_argument("--window", type=float, default=None, help="steady-state seconds (default: scaled with the ranks)")
    p.add_argument("--cap", type=float, default=None, help="seconds per size at most (default: scaled with the ranks)")
    p.add_argument("--store_steps", type=int, default=3, help="steps of rank-state records written (0: none)")
    p.add_argument("--record_bytes", type=int, default=RECORD_BYTES, help="bytes of one rank-state record")
    p.add_argument("--heartbeat_interval", type=float, default=1.0, help="seconds (ftrun's default)")
    p.add_argument("--heartbeat_timeout", type=float, default=5.0, help="seconds (ftrun's default)")
    p.add_argument("--step_s", type=float, default=1.0, help="simulated step time, seconds")
    p.add_argument("--heartbeat_relay", choices=("on", "off"), default="on",
                   help="the ranks of nodes other than 0 beat through their agent (on, ftrun's default from 256 ranks) "
                        "or node 0's coordinator (off: the design before the relay)")
    p.add_argument("--record_stores", choices=("node", "job"), default="node",
                   help="where the ranks' records go: their node's record store and a copy at the next node's "
                        "(node, ftrun's design for a multi-node job) or node 0's job store (job: the design before it)")
    p.add_argument("--sim_nice", type=int, default=0,
                   help="niceness of the simulation processes (they stand for other machines: node 0's go first)")
    p.add_argument("--sim_sched", choices=("batch", "other"), default="batch",
                   help="the simulation processes' scheduling policy: batch (SCHED_BATCH: their wake-ups do not "
                        "preempt node 0's processes, as another machine's never do; the same share of the CPU) or "
                        "other (the default policy, every process's)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--from_json", type=Path, default=None, help="print (and plot) the results of an earlier run")
    p.add_argument("--plot", type=Path, default=None, help="draw each cost against the ranks into this PNG")
    args = p.parse_args(argv)
    args.sizes = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    for n in args.sizes:
        if n < 2 * args.per_node or n % args.per_node:
            p.error(f"--ranks {n}: a multiple of --per_node {args.per_node}, at least two nodes")
    return args


def default_cap(ranks: int) -> float:
    """Seconds one size may take at most (16,384 ranks: 5 minutes)."""
    return 60.0 + ranks / 64


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    if args.from_json:
        results = json.loads(args.from_json.read_text())["results"]
    for n in [] if args.from_json else args.sizes:
        print(f"{n} ranks ({n // args.per_node} nodes of {args.per_node}):", flush=True)
        results.append(measure_size(n, args.per_node, args.window or default_window(n), args.cap or default_cap(n),
                                    args.store_steps, args.record_bytes, args.heartbeat_interval, args.step_s,
                                    args.heartbeat_timeout, say=lambda line: print(line, flush=True),
                                    sim_nice=args.sim_nice, sim_sched=args.sim_sched, relay=args.heartbeat_relay == "on",
                                    record_stores=args.record_stores))
    print()
    print(table(results))
    if args.json and not args.from_json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

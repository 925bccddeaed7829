"""The launcher: the ``ftrun`` process a user starts, one per node.

It hosts the job's c10d ``TCPStore`` on ``master_addr:master_port`` (node 0; other nodes connect to
it), starts the supervisor (:mod:`ftrun.node.supervisor`) as its child, draws the console from the
supervisor's event stream and the tailed ranks' logs, forwards SIGINT/SIGTERM, and exits with the
job's exit code. If the launcher is killed, the supervisor gets SIGTERM (``PR_SET_PDEATHSIG``) and
the ranks, tied the same way to the supervisor, die with it: no process outlives the launcher.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ftrun.common import contract, procs
from ftrun.node.agent import agent_log_name
from ftrun.config import ConfigError, JobSpec
from ftrun.node.console import JobConsole, make_console
from ftrun.common.protocol import MsgType, ProtocolError, Receiver, decode, events_for, new_token

FIRST_STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
ORPHAN_GASP_WAIT_S = 60.0  # how long ranks whose supervisor died get to write their dying gasp and exit
EVENT_READ_BUDGET = 1000  # event frames read per turn of the launcher's loop (then its child is checked)
EVENT_DRAIN_S = 3.0  # after the child's exit: how long what it sent last is read (a flood never ends)


def job_token(spec: JobSpec) -> str:
    """The job secret: ``FTRUN_TOKEN`` or ``--token_file`` where given (required for several
    nodes, so that every launcher has the same one), else a fresh one for this single-node job.

    Raises:
        ConfigError: an unreadable or too short token (see :func:`ftrun.config.read_job_token`).
    """
    from ftrun import config

    reader = getattr(config, "read_job_token", None)
    token = reader(spec, os.environ) if reader is not None else (os.environ.get("FTRUN_TOKEN") or None)
    if token is None and spec.nnodes > 1:
        raise ConfigError("a multi-node job needs a shared secret: set FTRUN_TOKEN (the same value on every node) "
                          "or --token_file FILE")
    return token or new_token()


def wait_for_control_addr(store: Any, spec: JobSpec) -> str:
    """The coordinator's control-plane endpoint, published by node 0 in the job's store.

    Raises:
        ConfigError: node 0 did not publish it within ``--cluster_time_out`` seconds.
    """
    try:
        return store.get(contract.CONTROL_ADDR_KEY).decode()
    except Exception as err:  # torch raises DistStoreError/RuntimeError on a timeout or a lost store
        raise ConfigError(
            f"node 0's coordinator did not come up within {spec.cluster_time_out:g} s ({str(err).splitlines()[0]}); "
            "start node 0 first, with the same --master_addr/--master_port"
        ) from None


def check_port_free(addr: str, port: int) -> None:
    """Fail early, before importing torch, when the master port is taken.

    Raises:
        ConfigError: the port is in use or the address cannot be bound here.
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--master_port {port} is already in use on this machine; pick a free port "
                    "(or --master_port 0 to let ftrun choose one)"
                ) from None
            raise ConfigError(f"cannot bind --master_port {port}: {err.strerror}; pick another port") from None


def can_host_store(spec: JobSpec) -> bool:
    """Whether this launcher is node 0 of a job whose node index is automatic: ``--master_addr``
    is one of this host's addresses (it can be bound here) and ``--master_port`` is free here.

    A second launcher on node 0's host finds the port taken and joins as a client; a host name
    that resolves to another address (as behind NAT) never hosts: give that node ``--node_rank 0``
    (or torchrun's ``--rdzv-conf is_host=1``).
    """
    try:
        infos = socket.getaddrinfo(spec.master_addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _type, _proto, _name, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
            except OSError:
                continue  # not an address of this host
        try:
            check_port_free(spec.master_addr, spec.master_port)
        except ConfigError:
            return False
        return True
    return False


def claim_node_rank(
    spec: JobSpec,
    store: Any,
    *,
    poll_interval: float = 0.2,
    stale_after: float = 10.0,
    claimant: str | None = None,
    clock: Any = time.monotonic,
    standby_node: bool = False,
) -> int:
    """This launcher's node index when none was given (torchrun's dynamic rendezvous), taken in
    node 0's store; node 0 itself is the launcher that hosts the store (:func:`can_host_store`).

    The first ``nnodes - 1`` launchers to connect take 1, 2, ... from the counter
    ``ftrun/next_node`` (``store.add``), skipping an index that a launcher given ``--node_rank`` (or a
    cluster's node index) has marked ``ftrun/node/<index>`` (:func:`host_store`). A later one
    replaces a lost node: it reads ``ftrun/vacant`` (the node indices the coordinator awaits a
    replacement for, see ``Coordinator.publish_vacancies``) and claims one with ``compare_set`` on
    ``ftrun/claim/<node>/<epoch>``, so that two launchers never take the same vacancy. While the
    claimed node is still listed as vacant (its agent has not joined yet) a thread beats on
    ``<claim>/beats`` for up to ``--cluster_time_out`` seconds; once it is not, the thread moves
    ``ftrun/claim_epoch/<node>`` on (also when the node was joined after the beats stopped), so a
    later loss of the same node is a new claim key. A claim whose beats stop for ``stale_after``
    seconds while the node is still vacant (its launcher died or took too long to join) is taken over. With
    nothing vacant it polls until ``--cluster_time_out``, or, with ``standby_node``, returns
    :data:`ftrun.common.contract.STANDBY_NODE_INDEX` at once: the launcher waits as a standby node, which the
    coordinator hands the next lost node (``take_node``, :mod:`ftrun.coordinator.membership`).

    Args:
        spec: the job (``nnodes``, ``cluster_time_out``, ``master_addr``/``master_port`` for messages).
        store: a client of node 0's store.
        poll_interval: seconds between looks at ``ftrun/vacant``, and between beats.
        stale_after: seconds without beats after which another launcher's claim is taken over.
        claimant: this launcher's name in the claim (default: host, pid and a random word).
        clock: monotonic seconds (tests).
        standby_node: become a standby node rather than wait for a vacancy.

    Returns:
        The node index, 1 .. nnodes-1, or ``STANDBY_NODE_INDEX`` (-1).

    Raises:
        ConfigError: no index was free or vacant within ``--cluster_time_out`` seconds.
    """
    try:
        claim = NodeIndexClaim(spec, store, claimant or f"{socket.gethostname()}/{os.getpid()}/{os.urandom(4).hex()}",
                               poll_interval=poll_interval, stale_after=stale_after, clock=clock)
        taken = claim.next_free_index()
        return taken if taken is not None else claim.wait_for_vacancy(standby_node)
    except (RuntimeError, OSError) as err:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
        raise ConfigError(
            f"lost node 0's store at {spec.master_addr}:{spec.master_port} while taking a node index "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); the job has ended or node 0 is gone"
        ) from None


class NodeIndexClaim:
    """One launcher's claim of a node index in node 0's store (:func:`claim_node_rank`).

    Args:
        spec: the job (``nnodes``, ``cluster_time_out``, ``master_addr``/``master_port`` for messages).
        store: a client of node 0's store.
        me: this launcher's name in a claim.
        poll_interval: seconds between looks at ``ftrun/vacant``, and between beats.
        stale_after: seconds without beats after which another launcher's claim is taken over.
        clock: monotonic seconds.
    """

    def __init__(self, spec: JobSpec, store: Any, me: str, *, poll_interval: float, stale_after: float,
                 clock: Any) -> None:
        self.spec, self.store, self.me = spec, store, me
        self.poll_interval, self.stale_after, self.clock = poll_interval, stale_after, clock
        self.beats_seen: dict[str, tuple[int, float]] = {}  # claim key -> (its beats, when they last changed)

    def vacant(self, on: Any) -> list[int]:
        """The node indices the coordinator awaits a replacement for, as store ``on`` lists them."""
        if not on.check([contract.VACANT_KEY]):
            return []
        text = on.get(contract.VACANT_KEY).decode(errors="replace")
        return [int(p) for p in text.split(",") if p.strip().isdigit() and 0 <= int(p) < self.spec.nnodes]

    def next_free_index(self) -> int | None:
        """The next index from the counter that no launcher given ``--node_rank`` holds; None when
        every node has one."""
        taken = int(self.store.add(contract.NEXT_NODE_KEY, 1))
        while taken < self.spec.nnodes:
            if self.store.compare_set(contract.node_key(taken), "", self.me).decode(errors="replace") == self.me:
                return taken
            taken = int(self.store.add(contract.NEXT_NODE_KEY, 1))  # a launcher given this index holds it: the next
        return None

    def wait_for_vacancy(self, standby_node: bool) -> int:
        """Claim a vacant node (polling until ``--cluster_time_out``), or, with ``standby_node``
        and none vacant now, return ``STANDBY_NODE_INDEX``.

        Raises:
            ConfigError: nothing was vacant in time.
        """
        deadline = self.clock() + self.spec.cluster_time_out
        while True:
            for node in self.vacant(self.store):
                if self.claim_vacancy(node):
                    return node
            if standby_node:
                return contract.STANDBY_NODE_INDEX
            if self.clock() >= deadline:
                spec = self.spec
                raise ConfigError(
                    f"no node index is free for this launcher: all {spec.nnodes} nodes of the job have launchers and "
                    f"none was lost and awaiting a replacement within --cluster_time_out {spec.cluster_time_out:g} s "
                    f"(store {spec.master_addr}:{spec.master_port}); give --node_rank, or start it when a node is lost"
                )
            time.sleep(self.poll_interval)

    def claim_vacancy(self, node: int) -> bool:
        """Claim vacant ``node`` under its current epoch, or take over a claim whose beats stopped
        for ``stale_after`` seconds; once claimed, beat for it (:meth:`keep_claim`)."""
        epoch = int(self.store.add(contract.claim_epoch_key(node), 0))
        key = contract.claim_key(node, epoch)
        holder = self.store.compare_set(key, "", self.me).decode(errors="replace")
        if holder != self.me:
            beats, now = int(self.store.add(key + "/beats", 0)), self.clock()
            if self.beats_seen.get(key, (None,))[0] != beats:
                self.beats_seen[key] = (beats, now)
                return False
            if now - self.beats_seen[key][1] < self.stale_after:
                return False
            if self.store.compare_set(key, holder, self.me).decode(errors="replace") != self.me:
                return False  # another launcher took it over first
        self.keep_claim(node, epoch, key)
        return True

    def keep_claim(self, node: int, epoch: int, key: str) -> None:
        """Beat on the claim ``key`` of ``node`` on a thread while the node is vacant (for up to
        ``--cluster_time_out``), then move the node's claim epoch on past ``epoch``."""
        try:
            watch = self.store.clone()  # a connection of its own: the launcher goes on using its store
        except Exception:
            watch = self.store
        until = self.clock() + self.spec.cluster_time_out

        def beat() -> None:
            try:
                while node in self.vacant(watch):
                    if self.clock() <= until:
                        watch.add(key + "/beats", 1)
                        time.sleep(self.poll_interval)
                    else:  # not joined in time: the beats stop, so another launcher may take the claim over,
                        time.sleep(max(self.poll_interval, 1.0))  # but whoever joins, the epoch must still move on
                watch.compare_set(contract.claim_epoch_key(node), str(epoch), str(epoch + 1))
            except Exception:  # node 0's store is gone: the job is over
                pass

        threading.Thread(target=beat, name=f"ftrun-claim-node-{node}", daemon=True).start()


def host_store(spec: JobSpec) -> tuple[Any, int, JobSpec, bool]:
    """Host (node 0) or join (other nodes) the job's TCPStore; return (store, port, spec, whether
    it is hosted here). A launcher that took node 0's index after a standby coordinator took the
    job over (:mod:`ftrun.coordinator.failover`) has node index 0 and does not host the store.

    With an automatic node index (``spec.node_rank_auto``), the launcher that can host the store
    (:func:`can_host_store`) is node 0 (or, when another launcher on this host binds the port
    first, a client); any other joins as a client and takes an index (:func:`claim_node_rank`), or
    becomes a standby node (index :data:`ftrun.common.contract.STANDBY_NODE_INDEX`) when every node has one and
    none is vacant. The returned spec has the index decided.

    Raises:
        ConfigError: the port is taken, node 0's store cannot be reached within cluster_time_out,
            or no node index is free.
    """
    hosting, spec = _whether_to_host(spec)  # checks the port, before the slow torch import
    if hosting:
        served = _serve_store(spec)
        if served is not None:
            store, port = served
            return store, port, dataclasses.replace(spec, node_rank=0, node_rank_auto=False), True
    store = _join_store(spec)
    if spec.node_rank_auto:
        spec = dataclasses.replace(spec, node_rank=claim_node_rank(spec, store, standby_node=True),
                                   node_rank_auto=False)
    else:
        try:  # a given index: launchers without one skip it (claim_node_rank)
            store.set(contract.node_key(spec.node_rank), "given")
        except (RuntimeError, OSError):
            pass  # the store is gone: waiting for the coordinator's address says so
    return store, spec.master_port, spec, False


def _whether_to_host(spec: JobSpec) -> tuple[bool, JobSpec]:
    """Whether this launcher hosts the store, and the spec to host it with: a single-node job whose
    default port is taken (another job on this machine) takes a free one, as torchrun does, rather
    than refuse to start.

    Raises:
        ConfigError: node 0's given port is taken.
    """
    if spec.node_rank_auto:
        return can_host_store(spec), spec
    if spec.node_rank != 0:
        return False, spec
    try:
        check_port_free(spec.master_addr, spec.master_port)
    except ConfigError:
        if not spec.master_port_auto:
            raise
        return True, dataclasses.replace(spec, master_port=0)
    return True, spec


def _serve_store(spec: JobSpec) -> tuple[Any, int] | None:
    """Serve the job's store here: (store, port); None when another launcher on this host took the
    port first with an automatic node index (it is node 0, this one joins it).

    Raises:
        ConfigError: the store cannot be bound.
    """
    from ftrun.common.stores import StoreBindError, bind_host, listen_socket, serve_store

    try:
        host = bind_host(spec.master_addr, spec.nnodes)
        if store_in_fork_server(spec):
            sock = listen_socket(host, spec.master_port)
            return sock, sock.getsockname()[1]
        return serve_store(host, spec.master_port, spec.cluster_time_out)
    except StoreBindError as err:
        if not (spec.node_rank_auto and err.errno == errno.EADDRINUSE):
            raise ConfigError(
                f"cannot host the rendezvous store on port {spec.master_port} ({err.strerror}); "
                "pick another --master_port"
            ) from None
        return None


def store_in_fork_server(spec: JobSpec) -> bool:
    """Whether node 0's fork server hosts the job's store (:func:`ftrun.rank.zygote.start_store`),
    this launcher only binding its socket: a single-node job whose ranks are forked (a Python
    script, ``--fork_server on``). Node 0 then imports torch once, in the fork server, not once
    more here (about 1.2 s of CPU, and of the job's start). A multi-node job's launcher uses the
    store itself (node indices, the coordinator's address), so it hosts it."""
    return (spec.nnodes == 1 and getattr(spec, "fork_server", "off") == "on" and not spec.module
            and not spec.no_python)


def _join_store(spec: JobSpec) -> Any:
    """A client of node 0's store.

    Raises:
        ConfigError: it cannot be reached within ``--cluster_time_out`` seconds.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        return TCPStore(spec.master_addr, spec.master_port, is_master=False, timeout=timedelta(seconds=spec.cluster_time_out))
    except (RuntimeError, OSError) as err:
        raise ConfigError(
            f"cannot reach node 0's store at {spec.master_addr}:{spec.master_port} within "
            f"{spec.cluster_time_out:g} s ({str(err).splitlines()[0]}); start node 0 first or check the address"
        ) from None


def _writable_log_dir(spec: JobSpec) -> Path:
    """``--log_dir``, made and checked writable.

    Raises:
        ConfigError: it cannot be made or written.
    """
    log_dir = Path(spec.log_dir)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / ".ftrun-write-test").touch()
        (log_dir / ".ftrun-write-test").unlink()
    except OSError as err:
        raise ConfigError(f"cannot write to --log_dir {spec.log_dir}: {err.strerror}; choose a writable directory") from None
    return log_dir


def _child_env(spec: JobSpec, token: str, events_port: int, store_port: int, control_addr: str | None) -> dict[str, str]:
    """The environment of this launcher's child: the job, its secret, the console's event endpoint,
    the store's port, and (for a node agent) the coordinator's endpoint."""
    env = dict(os.environ)
    env.update(
        {
            "FTRUN_SUPERVISOR_SPEC": json.dumps(spec.to_json()),
            "FTRUN_AGENT_SPEC": json.dumps(spec.to_json()),
            "FTRUN_TOKEN_FOR_SUPERVISOR": token,
            "FTRUN_EVENTS_ADDR": f"tcp://127.0.0.1:{events_port}",
            "FTRUN_STORE_PORT": str(store_port),
            "TORCHELASTIC_RUN_ID": getattr(spec, "run_id", None) or env.get("TORCHELASTIC_RUN_ID")
            or f"ftrun-{os.getpid()}-{int(time.time())}",
        }
    )
    if control_addr is not None:
        env["FTRUN_CONTROL_FOR_AGENT"] = control_addr
    return env


def record_store_socket(spec: JobSpec, env: dict[str, str]) -> socket.socket | None:
    """The listening socket of this node's record store (:mod:`ftrun.rank.rankstate`) in a
    multi-node job, bound on ``--local_addr`` (else this host's address towards node 0) on a free
    port, for the child to host (its fork server, or else itself: :class:`ftrun.node.forks.NodeStore`);
    its address goes into ``env`` (``FTRUN_RECORD_STORE``), for the agent to announce and its ranks
    to write to.
    None in a single-node job (the records go to the job's store), or when it cannot be bound
    (said once; the records then go to the job's store)."""
    if spec.nnodes < 2:
        return None
    from ftrun.common.stores import StoreBindError, listen_socket
    from ftrun.coordinator.failover import address_towards

    try:
        host = getattr(spec, "local_addr", None) or address_towards(spec.master_addr)
        sock = listen_socket(host, 0)
    except (OSError, StoreBindError) as err:
        print(f"ftrun: cannot bind this node's record store ({err}); its ranks' records go to node 0's store",
              file=sys.stderr, flush=True)
        return None
    env[contract.RECORD_STORE] = f"{host}:{sock.getsockname()[1]}"
    return sock


def _start_child(hosting: bool, env: dict[str, str], own_log: Path, store_socket: socket.socket | None = None) -> Any:
    """Start this launcher's child, its output in ``own_log``: node 0 runs the job coordinator with
    its own agent (``ftrun.node.supervisor``); every other node runs an agent (``ftrun.node.agent``).
    ``store_socket``: a store's listening socket, for the child to host that store on
    (``FTRUN_STORE_FD``): the job's on node 0 of a single-node job (:func:`store_in_fork_server`),
    else the node's record store (:func:`record_store_socket`). Returns its :class:`subprocess.Popen`; it
    gets SIGTERM when this launcher dies."""
    fds = (store_socket.fileno(),) if store_socket is not None else ()
    if store_socket is not None:
        env = {**env, "FTRUN_STORE_FD": str(store_socket.fileno())}
    with open(own_log, "ab") as sup_err:
        role = "ftrun.node.supervisor" if hosting else "ftrun.node.agent"
        return procs.spawn(
            procs.ftrun_module_argv(role),  # the installed ftrun, whatever the working directory holds
            env=env,
            stdout=sup_err.fileno(),
            stderr=sup_err.fileno(),
            death_signal=signal.SIGTERM,
            pass_fds=fds,
        )


class LogTailer:
    """Follows one rank's log file and returns complete new lines (msrun's --tail_worker_log)."""

    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.inode = path.stat().st_ino if path.exists() else None
        self.partial = b""

    def poll(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                inode = os.fstat(fh.fileno()).st_ino
                if inode != self.inode and self.inode is not None:
                    self.offset, self.partial = 0, b""  # made again (its directory was removed): read it from its start
                self.inode = inode
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines if not line.startswith(b"===== ftrun:")]


class Launcher:
    """Runs one node's share of a job; ``run()`` returns the exit code."""

    def __init__(self, spec: JobSpec, console: JobConsole | None = None) -> None:
        self.spec = spec
        self.console = console
        self.stop_signals: list[int] = []
        self._library_pids: set[int] = set()  # this node's ranks that use the worker library (rank_joined)
        self.tailers: list[LogTailer] = []

    def run(self) -> int:
        """Run this node's share of the job: host or join the store, start node 0's supervisor or
        another node's agent as a child, draw the console from its events and the ranks' logs until
        it exits, and return the job's exit code.

        Raises:
            ConfigError: an unwritable ``--log_dir``, a taken port, an unreachable store or no node
                index free (:func:`host_store`), no coordinator (:func:`wait_for_control_addr`).
        """
        spec = self.spec
        log_dir = _writable_log_dir(spec)
        store, port, spec, hosting = host_store(spec)  # checks the port first, before importing torch
        self.spec = spec  # with its node index decided, when it was automatic
        # A multi-node job shares its secret through every launcher's environment (FTRUN_TOKEN or
        # --token_file; checked by the configuration); a single-node job makes its own.
        token = job_token(spec)
        control_addr = None
        if not hosting:
            control_addr = wait_for_control_addr(store, spec)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        events_port = pull.bind_to_random_port("tcp://127.0.0.1")
        receiver = Receiver(token, events_for(spec.node_rank))
        env = _child_env(spec, token, events_port, port, control_addr)
        # Whatever the supervisor's ranks started is re-parented to this launcher if the supervisor
        # dies (SIGKILL): it is found and ended below, never left running.
        procs.become_subreaper()
        console = self.console or make_console(f"ftrun: {spec.script} on {spec.worker_num} rank(s)")
        self._install_signals()
        own_log = log_dir / ("supervisor.log" if hosting else agent_log_name(spec.node_rank))
        hosted = store if isinstance(store, socket.socket) else record_store_socket(spec, env)
        supervisor = _start_child(hosting, env, own_log, hosted)
        if hosted is not None and hosted is not store:
            hosted.close()  # the child has its own copy
        self.tailers = self._tailers(spec)
        handled, last_finish = self._follow(supervisor, console, pull, receiver)
        # Ranks of the worker library outlive a killed supervisor long enough for a dying gasp (a
        # plain script's ranks die with it: their death signal is SIGKILL).
        orphans = procs.wait_for_children(self._library_pids, ORPHAN_GASP_WAIT_S)
        procs.kill_descendants()  # ranks' children left by a supervisor that was killed
        last_finish = self._drain(console, pull, receiver) or last_finish
        self._tail_logs(console, final=True)
        pull.close(0)
        ctx.term()
        del store
        role = "supervisor" if hosting else "agent"
        code, last_finish = self._outcome(supervisor.returncode, last_finish, role, own_log,
                                          self._orphans_gasp(spec) if orphans and supervisor.returncode < 0 else "")
        if self.stop_signals and (code == 0 or handled > 1):
            code = FIRST_STOP_EXIT.get(self.stop_signals[0], 128 + self.stop_signals[0])
        console.finish(code, last_finish)
        return code

    def _follow(self, supervisor: Any, console: JobConsole, pull: zmq.Socket, receiver: Receiver) -> tuple[int, dict[str, Any] | None]:
        """Until the child exits: act on stop signals, show its events and the tailed ranks' logs.
        Returns the stop signals handled and the last ``job_finished`` event (None: none came)."""
        last_finish: dict[str, Any] | None = None
        handled = 0  # stop signals acted on: the first is forwarded, a second one kills without grace
        while True:
            handled = self.act_on_stops(supervisor.pid, handled)
            # The child's exit is noticed first, and each turn reads a bounded number of frames: a
            # flood on the (loopback) event endpoint can delay the console, never the launcher's end.
            if supervisor.poll() is not None:
                return handled, last_finish
            if pull.poll(100):
                for _ in range(EVENT_READ_BUDGET):
                    try:
                        frame = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_finish = self._dispatch(console, frame, receiver) or last_finish
            self._tail_logs(console)

    def _drain(self, console: JobConsole, pull: zmq.Socket, receiver: Receiver) -> dict[str, Any] | None:
        """Show what the child sent before it exited, for :data:`EVENT_DRAIN_S` at most (a flood
        never ends); returns the last ``job_finished`` event among it."""
        last_finish = None
        drain_until = time.monotonic() + EVENT_DRAIN_S
        while time.monotonic() < drain_until and pull.poll(200):
            last_finish = self._dispatch(console, pull.recv(), receiver) or last_finish
        return last_finish

    def _tail_logs(self, console: JobConsole, final: bool = False) -> None:
        """Show the tailed ranks' new log lines (``final``: their last partial lines too)."""
        for tailer in self.tailers:
            for line in tailer.poll(final=final):
                console.output(tailer.rank, line)

    @staticmethod
    def _outcome(code: int, last_finish: dict[str, Any] | None, role: str, own_log: Path,
                 orphans_gasp: str) -> tuple[int, dict[str, Any]]:
        """The exit code and the closing words for the child's ``code`` (``role``: supervisor or
        agent): a child killed by a signal says so, with what its orphaned ranks left
        (``orphans_gasp``); one that exited without a ``job_finished`` event says its code."""
        if code < 0:
            code, desc = procs.describe_exit(code)
            return code, {"message": f"the ftrun {role} was {desc}; see {own_log}" + orphans_gasp, "detail": {}}
        if last_finish is None:
            return code, {"message": f"the ftrun {role} exited with code {code}; see {own_log}", "detail": {}}
        return code, last_finish

    def _tailers(self, spec: JobSpec) -> list[LogTailer]:
        """The console's rank logs of this node (none while it is a standby)."""
        if spec.node_rank == contract.STANDBY_NODE_INDEX:
            return []
        tail_ranks = range(spec.local_worker_num) if spec.tail_worker_log is None else spec.tail_worker_log
        log_dir = Path(spec.log_dir)
        return [LogTailer(spec.global_rank(lr), log_dir / f"worker_{spec.global_rank(lr)}.log") for lr in tail_ranks]

    def _orphans_gasp(self, spec: JobSpec) -> str:
        """After the ranks outlived their supervisor: complete the checkpoint they wrote on their
        own (:func:`ftrun.common.checkpoint.complete_orphaned`) and say how to go on."""
        from ftrun.common.checkpoint import complete_orphaned

        if not spec.tft.ttp:
            return "; TTP is off: no dying-gasp checkpoint"
        skipped: list[str] = []
        manifest = complete_orphaned(Path(spec.checkpoint_dir).resolve(), on_skip=lambda path, why: skipped.append(why))
        if manifest is None:
            return "; the ranks left no complete dying-gasp checkpoint" + (f" ({skipped[0]})" if skipped else "")
        return (f"; the ranks wrote a dying-gasp checkpoint of step {manifest.step} ({manifest.directory}): "
                "run the same command with --resume auto to go on from it")

    def _dispatch(self, console: JobConsole, frame: bytes, receiver: Receiver) -> dict[str, Any] | None:
        try:
            msg = decode(frame, receiver)
        except ProtocolError:
            return None
        if msg.type == MsgType.EVENT:
            event = msg["event"]
            console.event(event)
            if (event.get("kind") == "rank_joined" and isinstance(event.get("pid"), int)
                    and event.get("node", 0) == self.spec.node_rank and (event.get("detail") or {}).get("library") is True):
                self._library_pids.add(event["pid"])
            took = (event.get("detail") or {}).get("node_joined")
            if (event.get("kind") == "node_joined" and self.spec.node_rank == contract.STANDBY_NODE_INDEX
                    and isinstance(took, int) and 0 <= took < self.spec.nnodes):
                self.spec = dataclasses.replace(self.spec, node_rank=took)  # this standby took a lost node's place
                self.tailers = self._tailers(self.spec)
            if event.get("kind") == "job_finished":
                return event
        elif msg.type == MsgType.STATUS:
            console.status(msg["ranks"])
        return None

    def act_on_stops(self, supervisor: int, handled: int) -> int:
        """Act on the stop signals received since the ``handled`` first ones, one by one: the first
        is forwarded to the supervisor (a graceful stop), any later one kills its tree without
        grace. Returns how many are handled now. Counted one at a time, so a second signal that
        arrives while the first is being forwarded is acted on too, never lost."""
        while len(self.stop_signals) > handled:
            if handled == 0:
                try:
                    os.kill(supervisor, self.stop_signals[0])
                except ProcessLookupError:
                    pass
            else:
                procs.kill_tree(supervisor)
            handled += 1
        return handled

    def _install_signals(self) -> None:
        def on_signal(signum: int, _frame: Any) -> None:
            self.stop_signals.append(signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        procs.dump_stacks_on_sigusr1()

"""ftrun's default process group across generations: built behind a join barrier, released and
dropped when it breaks, and a placeholder between two generations (the group's lifecycle, split
out of :class:`ftrun.rank.worker.Worker`).

A generation's group is built on the job's store under ``ftrun/attempt<A>/gen<G>/`` once every
rank of the world has joined that generation (:meth:`TrainingGroup.build`). When a collective fails
or a newer generation is announced the group is *dropped*: its own TCP connections are shut down so
that peers blocked on this rank fail at once (:mod:`ftrun.rank.conns`), it is unregistered, and a broken
gloo group is never destructed (:func:`retire`). Between generations a placeholder default group
(:class:`DownGroup`, backend :data:`DOWN_BACKEND`) stands, so ``dist.get_rank()``,
``dist.get_world_size()`` and a ``DistributedSampler`` keep working, and every collective raises
:class:`GroupDown` at once.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ftrun.common import contract
from ftrun.common.contract import RankEnv
from ftrun.rank.conns import GroupConnections
from ftrun.rank.cuda import Release, abort_group, release_for
from ftrun.errors import describe

BARRIER_NOTE_S = 10.0  # a rank waiting this long for its peers to join a generation says who is missing
DOWN_BACKEND = "ftrun_down"  # the backend name of the placeholder default group
STORE_CONNECT_TRY_S = 2.0  # a build's store connection asks between tries whether a newer abort came


class Abandoned(Exception):
    """A wait for the job's store was given up: a newer abort came meanwhile."""


class GroupDown(RuntimeError):
    """A collective called while this rank has no live process group (between generations)."""


class DownGroup(dist.ProcessGroup):
    """The default process group of a rank between generations: knows its rank and world size,
    fails every collective at once with :class:`GroupDown` (the step is then recovered)."""

    def getBackendName(self) -> str:
        return DOWN_BACKEND

    def _down(self, *_args: Any, **_kwargs: Any) -> Any:
        raise GroupDown("ftrun: this rank's process group is down (a recovery is under way); "
                        "the step's collectives fail and the step is retried")

    allreduce = allreduce_coalesced = broadcast = allgather = _allgather_base = reduce = gather = scatter = _down
    reduce_scatter = _reduce_scatter_base = alltoall = alltoall_base = send = recv = barrier = _down


_down_registered = False


def _register_down_backend() -> None:
    global _down_registered
    if not _down_registered:
        dist.Backend.register_backend(DOWN_BACKEND, lambda _store, rank, size, _timeout: DownGroup(rank, size),
                                      devices=["cpu", "cuda"])
        _down_registered = True


retired_groups = 0  # gloo process groups kept from their destructor (see retire)


def retire(group: Any) -> None:
    """Keep a gloo process group from ever being destructed: one extra reference, never released.
    Its destructor would join gloo's worker threads with the GIL held, which can block for the
    collective timeout on a work still in flight, or for ever on a worker thread that needs the GIL
    to free its last work (:meth:`TrainingGroup.drop`); unregistered by ``destroy_process_group``,
    the group only costs its idle threads and its sockets until the process exits, one per
    generation this rank lives through. At exit the process ends them with it, joining nothing."""
    global retired_groups
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    retired_groups += 1


def control_port() -> int:
    """The port of this rank's control channel (``FTRUN_CONTROL_ADDR``), 0 if none."""
    addr = os.environ.get(contract.CONTROL_ADDR, "")
    return int(addr.rsplit(":", 1)[1]) if ":" in addr else 0


class TrainingGroup:
    """One rank's default process group, generation after generation.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        world_size: ranks in the job.
        pg_timeout: the collectives' timeout, in seconds (``--pg_timeout``).
        cluster_timeout: how long a connection to the job's store may take, in seconds.

    Attributes:
        rank: this rank (None until bound: a hot spare has none before its promotion).
        managed: whether ftrun recovers this rank (a managed group is rebuilt per generation; an
            unmanaged one is torch's usual ``init_process_group`` from the environment, once).
        attempt, incarnation: the whole-job attempt and this rank's incarnation.
        conns: the connections of the current group (:class:`ftrun.rank.conns.GroupConnections`).
    """

    def __init__(self, backend: str, world_size: int, pg_timeout: float, cluster_timeout: float) -> None:
        self.backend = backend
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.cluster_timeout = cluster_timeout
        self.rank: int | None = None
        self.managed = False
        self.attempt = 0
        self.incarnation = 0
        self.placeholder = False  # the default process group is a DownGroup (see install_placeholder)
        self.conns = GroupConnections()
        self._aborting: threading.Thread | None = None  # an NCCL abort the I/O thread handed off (see cut)
        self._store: Any = None
        self.store_moves = 0  # times the job's store moved (a coordinator takeover): clients made before are stale
        # Called after each generation's group is built, before its connections are recorded: a
        # DeviceMesh's groups built again there are cut with the group (ftrun.rank.sharding).
        self.after_build: list[Callable[[], None]] = []

    def bind(self, rank: int, incarnation: int, attempt: int, managed: bool) -> None:
        """Set this rank's identity (at start, or at a hot spare's promotion, which also brings
        the rank's environment: the store's and the control channel's ports are read here)."""
        self.rank, self.incarnation, self.attempt, self.managed = rank, incarnation, attempt, managed
        self.conns.keep_ports = {p for p in (int(os.environ.get(contract.MASTER_PORT) or 0), control_port()) if p}

    def move_store(self, addr: str) -> bool:
        """Use the store at ``addr`` (``host:port``) from now on: a standby coordinator that took
        the job over hosts it (:mod:`ftrun.coordinator.failover`). ``MASTER_ADDR``/``MASTER_PORT``
        follow, so every later client (the rank's records, an ``env://`` group) connects there.
        False if it is the store in use already."""
        host, _, port = addr.rpartition(":")
        if (os.environ.get(contract.MASTER_ADDR), os.environ.get(contract.MASTER_PORT)) == (host, port):
            return False
        os.environ[contract.MASTER_ADDR], os.environ[contract.MASTER_PORT] = host, port
        self._store = None
        self.store_moves += 1
        self.conns.keep_ports = {p for p in (int(port), control_port()) if p}
        return True

    def store(self, abandon: Callable[[], bool] | None = None) -> Any:
        """The job's store (a ``TCPStore`` client on ``MASTER_ADDR:MASTER_PORT``), connected once.

        ``abandon``: while connecting, asked every :data:`STORE_CONNECT_TRY_S` seconds; when it
        says so, :class:`Abandoned` is raised (the store's host died with the coordinator that
        named it, and a newer abort came: a client would otherwise retry for the whole
        ``--cluster_time_out``)."""
        if self._store is None:
            self._store = self.connect_store(abandon)
        return self._store

    def connect_store(self, abandon: Callable[[], bool] | None = None) -> Any:
        """A new ``TCPStore`` client on the job's store (for another thread: a client is one
        connection, not to be shared between threads); ``abandon`` as in :meth:`store`.

        Raises:
            Abandoned: ``abandon()`` said so while this waited for the store.
            torch.distributed.DistError: the store did not answer within ``--cluster_time_out``."""
        addr = os.environ.get(contract.MASTER_ADDR) or RankEnv.master_addr
        port = int(os.environ[contract.MASTER_PORT])
        full = timedelta(seconds=self.cluster_timeout)
        if abandon is None:
            return dist.TCPStore(addr, port, is_master=False, timeout=full)
        deadline = time.monotonic() + self.cluster_timeout
        while True:
            try:
                store = dist.TCPStore(addr, port, is_master=False,
                                      timeout=timedelta(seconds=min(STORE_CONNECT_TRY_S, self.cluster_timeout)))
            except dist.DistError:
                if abandon():
                    raise Abandoned(f"the store at {addr}:{port} did not answer and a newer abort came") from None
                if time.monotonic() > deadline:
                    raise
                continue
            store.set_timeout(full)
            return store

    def build(self, generation: int, abandon: Callable[[], bool]) -> bool:
        """Build the default process group of ``generation``. False if ``abandon()`` said a newer
        abort overtook it while this rank waited for its peers (it is called every few ms there).

        Raises: whatever ``init_process_group`` raises (a peer gone during the rendezvous)."""
        if not self.managed:
            if not dist.is_initialized():
                dist.init_process_group(self.backend, timeout=timedelta(seconds=self.pg_timeout))
            return True
        try:
            store = dist.PrefixStore(contract.generation_prefix(self.attempt, generation), self.store(abandon))
        except Abandoned:
            return False
        if not self._join_barrier(store, generation, abandon):
            return False
        self.remove_placeholder()
        self._aborting = None  # the last generation's abort, if any, was of the last group
        self.conns.begin()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore("pg/", store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.pg_timeout),
        )
        for hook in self.after_build:
            hook()
        self.conns.end()
        return True

    def record_connections(self, build: Callable[[], Any]) -> Any:
        """Run ``build`` (it makes more process groups on the live group: a DeviceMesh's) and record
        the connections it opens as the group's, so :meth:`cut` releases collectives on them too.
        On the placeholder group (a respawned rank before its recovery) ``build`` runs on torch's
        ``fake`` backend instead, which then stays the placeholder until the next generation: its
        collectives communicate nothing and succeed (the set-up's ``fully_shard`` and tensor-parallel
        scatters cut slices the rank's recovery overwrites with its replica's), and the groups made
        on it stand in until the next generation's replace them. Returns what ``build`` returns."""
        if self.placeholder:
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers torch's "fake" backend)

            self.remove_placeholder()
            dist.init_process_group("fake", store=dist.HashStore(), rank=self.rank, world_size=self.world_size)
            self.placeholder = True  # the placeholder until the next generation, which destroys it
            return build()
        if not (self.managed and self.live()):
            return build()
        self.conns.begin()
        try:
            return build()
        finally:
            self.conns.end(extend=True)

    def _join_barrier(self, store: Any, generation: int, abandon: Callable[[], bool]) -> bool:
        """Wait until every rank has joined ``generation`` (False if ``abandon()`` said so).

        A barrier this rank can leave: ``init_process_group`` cannot be interrupted, and waits for
        a rank that never comes for the whole collective timeout. Each rank sets its own key
        (``joined/<rank>`` = its incarnation) and waits for all of them, so the barrier counts
        ranks, not calls (a counter once let three ranks into the group's rendezvous without the
        fourth, which sat in the barrier: a soak run, all four held for the 300 s store timeout).
        After :data:`BARRIER_NOTE_S` it names the missing ranks in its log.
        """
        store.set(contract.JOINED_KEY.format(rank=self.rank), str(self.incarnation))
        keys = [contract.JOINED_KEY.format(rank=r) for r in range(self.world_size)]
        started = time.monotonic()
        noted = False
        while not store.check(keys):
            if abandon():
                return False
            if not noted and time.monotonic() - started > BARRIER_NOTE_S:
                noted = True
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                print(f"ftrun: rank {self.rank}: generation {generation}: waited {BARRIER_NOTE_S:g} s for "
                      f"rank(s) {missing} to join", file=sys.stderr, flush=True)
        return True

    def abandon_build(self, generation: int) -> None:
        """A build of ``generation`` raised (its store or a peer went away): drop what it left (a
        group, if one was made), forget the store client (a new one connects on next use) and
        stand on the placeholder group until the next generation."""
        self.drop(generation)
        self.conns.forget()
        self._store = None
        self.install_placeholder()

    def live(self) -> bool:
        """Whether this rank holds a working process group (not the placeholder)."""
        return dist.is_initialized() and not self.placeholder

    def install_placeholder(self) -> None:
        """Make the default process group a :class:`DownGroup` while this rank has no live one (a
        respawned rank before its recovery, a survivor after a failed collective until the next
        generation): ``dist.get_rank()``, ``dist.get_world_size()`` and ``DistributedSampler``
        keep working, and every collective raises :class:`GroupDown` at once, which the step
        records as a failed collective (torch.distributed stays usable)."""
        if self.placeholder or self.rank is None or self.world_size <= 1 or not self.managed or dist.is_initialized():
            return
        _register_down_backend()
        dist.init_process_group(DOWN_BACKEND, store=dist.HashStore(), rank=self.rank, world_size=self.world_size)
        self.placeholder = True

    def remove_placeholder(self) -> None:
        if self.placeholder:
            self.placeholder = False
            dist.destroy_process_group()

    def cut(self, wait: bool = True) -> None:
        """Release a collective blocked on the current group (:func:`ftrun.rank.cuda.release_for`): gloo's
        connections (those recorded when it was built) are shut down, NCCL's communicators aborted
        through torch's ``ProcessGroup.abort()``; the collective fails at once. Nothing else the
        process holds is touched. Safe from any thread.

        ``wait=False`` (the I/O thread) hands an NCCL abort to a thread of its own: on an H200 with
        torch 2.11 ``abort()`` held its caller until the GPU work queued ahead of the collective ended
        (2.2-2.5 s behind a 3 s kernel, docs/gpu.md), and the I/O thread must go on beating. A later
        ``cut()`` that waits (the group's teardown) joins that abort instead of making a second one."""
        if release_for(self.backend) is Release.CUT_CONNECTIONS:
            self.conns.cut()
            return
        pending = self._aborting
        if pending is not None:
            if wait:
                pending.join()
            return
        if not self.live():
            return
        if wait:
            self._abort()
            return
        self._aborting = threading.Thread(target=self._abort, name="ftrun-nccl-abort", daemon=True)
        self._aborting.start()

    @staticmethod
    def _abort() -> None:
        try:
            abort_group(dist.group.WORLD)
        except Exception as err:  # a group torn down meanwhile by the training thread
            print(f"ftrun: aborting the NCCL group failed: {describe(err)}", file=sys.stderr, flush=True)

    def drop(self, generation: int, broken: bool = True) -> None:
        """Destroy the current group and cut its connections now, releasing peers blocked on us.

        A ``broken`` group (a failed step, an abort, a failed transfer) has its connections cut
        *before* it is destroyed: gloo's teardown waits for work still in flight (an abandoned
        asynchronous all-reduce whose peer is gone), and only a cut connection makes that work
        fail at once (CI saw a survivor wait in ``destroy_process_group`` past the abort's
        deadline and be replaced as hung). A group ending cleanly (``ft.finish()``) is destroyed
        first, so nothing its peers still read is cut.

        Destroying the group is not enough with gloo: the process group object outlives
        ``destroy_process_group`` while anything still references it (a failed work, an
        exception's traceback), and its sockets stay open, so a peer blocked in a collective with
        us waits for the full timeout. Shutting down the group's TCP connections (recorded when it
        was built, :mod:`ftrun.rank.conns`; the user's own connections are left alone) makes each such
        peer fail within milliseconds; the descriptors stay owned by gloo, which closes them when it
        lets go.

        A gloo group is never destructed (:func:`retire`), broken or not: gloo's destructor joins its
        worker threads, and a work still in flight there (one the cut did not fail) held the
        training thread for longer than the abort's deadline (a fresh-clone CI run: the stack ended
        in this method, destroy_process_group already returned), so the rank was replaced as hung.
        A group ending cleanly deadlocked instead: its last reference (a DDP reducer's, dropped as
        the script's function returned after ``ft.finish()``) ran the destructor with the GIL held,
        joining a worker thread that was still releasing its last work and waited for the GIL to
        free that work's tensors (seen under torchrun on a loaded machine: one rank of four never
        exited, its main thread in ``std::thread::join`` under ``~ProcessGroupGloo``, a
        ``pt_gloo_runloop`` thread in ``take_gil`` under ``~AsyncWork``).
        ``generation`` only names the group in a teardown failure's log line.
        """
        if self.placeholder:
            if not broken:
                self.remove_placeholder()  # ft.finish(): leave no group behind, as with a real one
            return
        if not dist.is_initialized():
            return
        retired = dist.group.WORLD if self.backend == "gloo" else None
        if broken and self.managed:
            self.cut()  # gloo's connections, NCCL's communicators: or the teardown waits for the failed work
        failure = None
        try:
            dist.destroy_process_group()
        except Exception as err:  # a broken group may fail to tear down cleanly
            failure = describe(err)
        if retired is not None:
            retire(retired)
            del retired
        if failure is not None:
            print(f"ftrun: tearing down generation {generation} failed: {failure}", file=sys.stderr, flush=True)
        if self.backend == "gloo" and self.managed:
            self.cut()
        self.conns.forget()
        if broken:
            self.install_placeholder()

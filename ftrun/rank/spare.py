"""A warm spare: a process that has already paid for ``import torch`` and waits to become a rank.

Respawning a rank costs a new interpreter and its imports (about 1.2 s for torch alone on an idle
machine, several seconds on a busy one; docs/benchmarks.md), and that is most of an ARF recovery. The
supervisor therefore keeps ``--warm_spares`` processes started as ``python -m ftrun.rank.spare`` (but
with the installed ftrun whatever the working directory holds: :func:`ftrun.node.spawner.spare_argv`): each
imports torch, torch.distributed, numpy, the worker library and, for a script that imports ftrun
(``--with_dynamo``), ``torch._dynamo``, which the first ``torch.optim`` optimizer imports (at idle
priority: it is started while the ranks train, :func:`import_at_idle_priority`), then blocks
reading its standard input. To replace a failed rank, the supervisor writes one JSON object there
and closes it::

    {"env": {...the rank's environment...}, "argv": [script, args...], "module": false,
     "log": "/path/worker_<rank>.log", "cwd": "/path"}

The spare takes that environment, sends its output to the rank's log, and runs the script as
``__main__`` (``runpy``), exactly as ``python script args`` would, in a process that is already
the supervisor's child, in its own session and tied to the supervisor's life. JSON only: nothing
arriving here is unpickled. An idea from hot-spare schemes in elastic training (e.g. MindCluster's
standby processes), applied to the interpreter rather than the node.

A *hot* spare (``--hot_spares``, ``python -m ftrun.rank.spare --hot``) goes further: it runs the script
at once, without a rank, through its own set-up (imports, data, model, optimizer) up to the
training loop, where the worker library waits for the same assignment and binds the rank late
(docs/hot_spares.md).

Neither kind of spare is started with a rank's identity (``RANK`` and the other
:data:`ftrun.common.contract.IDENTITY_VARS` are absent), so a process listing never shows a spare as a
rank. A process cannot move its initial environment block (what ``/proc/<pid>/environ`` and
``ps e`` show; ``os.environ`` changes only the C library's copy), but it may rewrite the bytes in
it: a spare's environment ends with :data:`ftrun.common.contract.IDENTITY_PAD`, room that its promotion
overwrites with the rank's identity (:func:`ftrun.rank.promotion.show_identity`, the trick ``setproctitle`` plays on
the argument block). So each rank's ``RANK`` shows on exactly one process, the one serving it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

from ftrun.common.contract import DYNAMO_FLAG, SPARE_JOB
from ftrun.rank.promotion import take_assignment


def run_script(argv: list[str], module: bool) -> None:
    """Run the script as ``__main__`` (``runpy``), as ``python script args`` would (``python -m
    module args`` when ``module``): with the script's directory (the working directory for a
    module) first on ``sys.path``, for the script's own imports, as torchrun's ranks have it.

    The spare was started without the working directory on its path
    (:func:`ftrun.node.spawner.spare_argv`), so the ftrun and torch it has imported are the installed
    ones whatever that directory holds; the script's entry is added here, in front. Under
    ``PYTHONSAFEPATH`` Python adds none for a script, and neither does this.

    Args:
        argv: the script's path (the module's name when ``module``) and its arguments.
        module: run ``argv[0]`` as a module.

    Raises:
        whatever the script raises (``SystemExit`` included).
    """
    sys.argv = argv
    safe = getattr(sys.flags, "safe_path", False)  # PYTHONSAFEPATH (3.11+)
    if module:
        if not safe:
            sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        if not safe:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def import_libraries(dynamo: bool = True) -> None:
    """Import what a respawned rank would otherwise import after its start (the slow part): numpy,
    torch, torch.distributed, the worker library and, when ``dynamo``, ``torch._dynamo``.

    ``dynamo`` is False for a script written for torchrun (:func:`ftrun.node.spawner.imports_ftrun`).
    Under torch 2.13, a DDP script that starts with ``torch._dynamo`` already imported could hang at
    its exit, forked or not (measured: 1 of 5 runs in a new interpreter, 8 of 18 forked; 0 of 21
    without it): the DDP Reducer frees its gloo group holding the GIL, while a gloo thread that drops
    the last reference to a tensor's Python object waits for the GIL and holds the lock the group's
    destructor takes. Such a script imports torch._dynamo itself, at its first optimizer, as it
    would under torchrun. The worker library's scripts showed no such hang in the suite's runs.
    """
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from ftrun.rank import worker  # noqa: F401

    # torch.optim's first optimizer imports torch._dynamo (torch._compile._disable_dynamo, torch
    # 2.x): 1.3 s of CPU on this project's machines, as much again as torch itself, which a rank
    # respawned from this spare would pay inside the recovery.
    if not dynamo:
        return
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # a build without it: the script imports what it needs itself
        pass


def _set_policy(tid: int, policy: int) -> bool:
    """Set thread ``tid``'s scheduling policy (Linux: per thread); False where it cannot be."""
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except (AttributeError, OSError):  # not Linux, or no right to raise a thread's priority back
        return False


def _can_leave_idle(idle_policy: int) -> bool:
    """Whether a thread of this process may go from ``SCHED_IDLE`` back to the normal policy
    (root, ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that allows it), tried on a throwaway thread."""
    import threading

    ok: list[bool] = []
    probe = threading.Thread(target=lambda: ok.append(_set_policy(0, idle_policy) and _set_policy(0, os.SCHED_OTHER)))
    probe.start()
    probe.join()
    return bool(ok and ok[0])


def _leave_idle(idle_policy: int, keep: int) -> None:
    """Put every thread of this process but ``keep`` that is scheduled ``SCHED_IDLE`` back to the
    normal policy (the import's helper, and any pool a library started while it imported)."""
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if tid != keep and os.sched_getscheduler(tid) == idle_policy:
                _set_policy(tid, os.SCHED_OTHER)
        except OSError:  # the thread ended meanwhile
            pass


def import_at_idle_priority(poll_s: float = 0.05, dynamo: bool = True) -> bool:
    """Import what a rank needs (numpy, torch, torch.distributed, the worker library) on a helper
    thread scheduled ``SCHED_IDLE``, so a warm spare started while the ranks train takes only CPU
    time they leave unused (on 2 cores, a warm spare's 1.5 s of imports overlapped the
    first seconds of a job's training and slowed those steps).

    A thread that a library starts during its import inherits the policy (OpenBLAS starts its
    pool when numpy is imported), so once the imports end, every thread left at ``SCHED_IDLE`` is
    put back to the normal policy; the thread that runs the script never leaves it. Leaving
    ``SCHED_IDLE`` needs root, ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows it: where this
    process has none of them, the imports run at the normal priority, as they always did. If the
    spare's standard input becomes readable before the imports end (its assignment: a rank waits
    for it), they are put back to the normal policy at once.

    Args:
        poll_s: seconds between looks at standard input while the imports run.
        dynamo: import ``torch._dynamo`` too (:func:`import_libraries`).

    Returns:
        True if the imports started at idle priority (False: at the normal one, where
        ``SCHED_IDLE`` does not exist or could not be left again).

    Raises:
        whatever the imports raise (re-raised on this thread).
    """
    import select
    import threading

    idle_policy = getattr(os, "SCHED_IDLE", None)
    if idle_policy is None or not os.path.isdir("/proc/self/task") or not _can_leave_idle(idle_policy):
        import_libraries(dynamo)
        return False
    main_tid = threading.get_native_id()
    failure: list[BaseException] = []

    def run() -> None:
        _set_policy(0, idle_policy)
        try:
            import_libraries(dynamo)
        except BaseException as err:  # re-raised on the main thread
            failure.append(err)

    helper = threading.Thread(target=run, name="ftrun-spare-import", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(poll_s)
        try:
            readable = select.select([sys.stdin], [], [], 0)[0]
        except (OSError, ValueError):  # no standard input to watch
            readable = []
        if readable and helper.is_alive():  # assigned (or no longer needed): finish at the normal priority
            _leave_idle(idle_policy, main_tid)
            helper.join()
    _leave_idle(idle_policy, main_tid)
    if failure:
        raise failure[0]
    return True


def main() -> None:
    dynamo = DYNAMO_FLAG in sys.argv[1:]
    if "--hot" in sys.argv[1:]:
        # A hot spare is there to be past its set-up before the next fault (the user asked for
        # one): on a node whose ranks keep every core busy, an idle-priority import could wait
        # until that fault. So it imports at the normal priority, then runs the script now,
        # without a rank; ftrun.init() gives it none until take_assignment() returns (called by
        # the worker library at the training loop, or when the script first asks for its rank).
        import_libraries(dynamo)
        job = json.loads(os.environ[SPARE_JOB])
    else:
        started = time.monotonic()
        idle = import_at_idle_priority(dynamo=dynamo)  # a warm spare's imports are promoted with its assignment
        # Into spares.log: when the spare can take a rank (its imports are the job's one-time
        # cost on a busy node: scripts/bench.py measures a steady state from this moment on).
        print(f"ftrun: warm spare (pid {os.getpid()}) ready at {time.time():.3f}: its imports took "
              f"{time.monotonic() - started:.2f} s{' at idle priority' if idle else ''}", flush=True)
        job = take_assignment(hot=False)
    os.chdir(job["cwd"])
    run_script([str(a) for a in job["argv"]], bool(job["module"]))


if __name__ == "__main__":
    main()

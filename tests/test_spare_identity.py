"""Spares carry no rank identity until their promotion: during a run, a process listing
(``ps e``: each process's ``/proc/<pid>/environ``, the block it was started with) shows each
rank's ``RANK`` on exactly one process, the one serving that rank, even after a warm or hot spare
was promoted to a failed rank's identity; a spare still waiting shows none."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import digits_job as dj
import psutil
import pytest

pytestmark = [pytest.mark.integration]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def _job_processes(root: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(root).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


# Where a rank's process comes from: forked by the node's fork server (which is the node's warm
# spare), or a hot spare promoted; and which waiting process must show no rank.
WAITING = {"--fork_server": ("ftrun.rank.zygote", 1), "--hot_spares": ("ftrun.rank.spare", 2)}


@pytest.mark.parametrize("spares, value", [("--fork_server", "on"), ("--hot_spares", "1")])
def test_each_rank_shows_on_exactly_one_process(tmp_path: Path, spares: str, value: str) -> None:
    log_dir = tmp_path / "logs"
    cmd = dj.cmd(log_dir, dj.LONG_STEPS)
    at = cmd.index(str(dj.SCRIPT))
    cmd = [*cmd[:at], spares, value, *cmd[at:], "--step_pause", "0.2"]
    waiting, count = WAITING[spares]
    proc = subprocess.Popen(cmd, env=dj.env({"FTRUN_FAULT": "rank=2,step=6,kind=kill"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True)
    try:
        dj.wait_for(lambda: [e for e in dj.events(log_dir) if e["kind"] == "recovery_finished"] or proc.poll() is not None,
                    timeout=240)
        assert proc.poll() is None, "the job ended before its recovery was seen"
        started = [e for e in dj.events(log_dir) if e["kind"] == "rank_started"]
        promoted = started[-1]
        assert promoted["rank"] == 2 and (promoted["detail"].get("warm_spare") or promoted["detail"].get("hot_spare")), started
        # The node starts a new hot spare in place of the promoted one (the fork server stays): wait
        # until it is up, then look.
        dj.wait_for(lambda: sum(waiting in " ".join(p.cmdline()) for p in _job_processes(proc.pid)) >= count
                    or proc.poll() is not None, timeout=120)
        assert proc.poll() is None, "the job ended before its waiting processes were seen"
        serving = {e["rank"]: e["pid"] for e in started}.values()  # each rank's newest process
        shown: dict[str, list[int]] = {}
        spare_pids = []
        for p in _job_processes(proc.pid):
            env = _environ(p.pid)
            if "RANK" in env:
                shown.setdefault(env["RANK"], []).append(p.pid)
            if waiting in " ".join(p.cmdline()) and p.pid not in serving:
                spare_pids.append(p.pid)
                assert "RANK" not in env and "LOCAL_RANK" not in env, (p.pid, env.get("RANK"))
        assert sorted(shown) == ["0", "1", "2", "3"], shown
        assert all(len(pids) == 1 for pids in shown.values()), shown  # never two processes with one RANK
        assert shown["2"] == [promoted["pid"]], (shown, promoted)
        assert _environ(promoted["pid"]).get("LOCAL_RANK") == "2"
        if spares == "--fork_server":  # a forked rank shows its own command, not the fork server's
            assert psutil.Process(promoted["pid"]).cmdline()[:3] == [sys.executable, "-u", str(dj.SCRIPT)]
        assert spare_pids, "no waiting spare was found"
    finally:
        # What the promoted spare computes is checked bitwise elsewhere (test_hot_spares, test_arf:
        # the same promotion): here the job need not run to its end. Stopped as a user would.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# A spare's imports at idle priority: a stand-in for the imports starts a thread that
# stays (as OpenBLAS starts its pool when numpy is imported) and records the scheduling policy its
# own thread ran with, in a fresh process whose standard input is given or withheld.
_PRIORITY_PROBE = """
import os, sys, threading, time
import ftrun.rank.spare as spare
seen, pool, stop = [], [], threading.Event()
def imports(dynamo=True):
    threading.Thread(target=lambda: (pool.append(threading.get_native_id()), stop.wait()), daemon=True).start()
    time.sleep(float(sys.argv[1]))
    seen.append(os.sched_getscheduler(0))
spare.import_libraries = imports
before = os.sched_getscheduler(0)
ran_idle = spare.import_at_idle_priority(poll_s=0.01)
print(ran_idle, seen[0], before, os.sched_getscheduler(0), os.sched_getscheduler(pool[0]))
"""


def _probe(sleep_s: float, stdin: bytes | None) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-c", _PRIORITY_PROBE, str(sleep_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=False)
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.flush()
    out = proc.stdout.read()  # the input stays open (an EOF is readable too), as a waiting spare's does
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    return out.decode().split()


_ROOT_ONLY = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0,
                                reason="leaving SCHED_IDLE needs root or CAP_SYS_NICE (Linux)")


@_ROOT_ONLY
def test_a_spare_imports_at_idle_priority_and_leaves_no_thread_there() -> None:
    ran_idle, during, before, after, pool = _probe(0.3, None)
    assert (ran_idle, during) == ("True", str(os.SCHED_IDLE))
    assert before == after == str(os.SCHED_OTHER)  # the thread that runs the script never changes
    assert pool == str(os.SCHED_OTHER)  # a thread a library started while importing is put back


@_ROOT_ONLY
def test_a_spare_assigned_before_its_imports_end_finishes_them_at_the_normal_priority() -> None:
    ran_idle, during, before, after, pool = _probe(2.0, b'{"env": {}}')  # an assignment waits on its input
    assert (ran_idle, during, pool) == ("True", str(os.SCHED_OTHER), str(os.SCHED_OTHER))
    assert before == after == str(os.SCHED_OTHER)


def test_a_spare_that_could_not_leave_idle_priority_imports_at_the_normal_one(monkeypatch) -> None:
    import ftrun.rank.spare as spare

    seen = []
    monkeypatch.setattr(spare, "_can_leave_idle", lambda _policy: False)
    monkeypatch.setattr(spare, "import_libraries", lambda dynamo=True: seen.append(os.sched_getscheduler(0)))
    assert spare.import_at_idle_priority() is False
    assert seen == [os.sched_getscheduler(0)]  # on this thread, at its own priority


def test_a_warm_spare_imports_what_the_first_optimizer_would() -> None:
    """The first ``torch.optim`` optimizer imports ``torch._dynamo`` (1.3 s of CPU here, as much as
    torch): a warm spare imports it too, so a rank respawned in it does not pay it in the recovery."""
    probe = ("import sys, ftrun.rank.spare as spare; spare.import_libraries(); "
             "print(sorted(m for m in ('numpy', 'torch', 'torch.distributed', 'torch._dynamo', 'ftrun.rank.worker') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=dj.env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "['ftrun.rank.worker', 'numpy', 'torch', 'torch._dynamo', 'torch.distributed']", done.stdout


def test_a_warm_spare_says_when_it_is_ready() -> None:
    """A warm spare's imports are a job's one-time cost: it says in ``spares.log`` (its output)
    when they ended, as a Unix time (``scripts/bench.py`` starts its steady state there), and a
    spare whose input closes without an assignment exits 0."""
    started = time.time()
    done = subprocess.run([sys.executable, "-u", "-m", "ftrun.rank.spare"], input=b"", capture_output=True, timeout=120,
                          env=dj.env())
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(rb"ftrun: warm spare \(pid (\d+)\) ready at (\d+\.\d+): its imports took (\d+\.\d+) s", done.stdout)
    assert match, done.stdout[-2000:]
    assert started <= float(match.group(2)) <= ended
    assert 0 < float(match.group(3)) <= ended - started

"""Hot spares: spares past the script's set-up, promoted to a failed rank's identity.

Each job trains the 4-rank digits job for LONG_STEPS steps, stretched by ``--step_pause`` (a sleep:
same result, little CPU; the shared job only while its faults are sent), and must end bitwise equal
to the fault-free run. Faults fire at named
injection points once the test creates their trigger file (``when=``), i.e. once a hot spare waits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import digits_job as dj
import pytest

pytestmark = [pytest.mark.integration]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
READY = re.compile(r"ftrun: hot spare \(pid (\d+)\) waits for a rank at the training loop")


def _start(tmp_path: Path, fault: str, script: Path = dj.SCRIPT, *script_args: str, pause: str = "0.4",
           max_restarts: str = "4", pause_while: Path | None = None) -> subprocess.Popen:
    cmd = dj.cmd(tmp_path / "logs", dj.LONG_STEPS)
    cmd[cmd.index("--max_restarts") + 1] = max_restarts
    at = cmd.index(str(dj.SCRIPT))
    cmd = [*cmd[:at], "--hot_spares", "1", str(script), *script_args, *cmd[at + 1:], "--step_pause", pause]
    if pause_while is not None:
        cmd += ["--pause_while", str(pause_while)]
    return subprocess.Popen(cmd, env=dj.env({"FTRUN_FAULT": fault}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, start_new_session=True)


def _ready(log_dir: Path) -> list[int]:
    path = log_dir / "spares.log"
    return [int(m) for m in READY.findall(path.read_text())] if path.exists() else []


def _wait_recoveries(proc: subprocess.Popen, log_dir: Path, n: int) -> None:
    """Until ``n`` recoveries have finished (or the job has ended)."""
    dj.wait_for(lambda: len([e for e in dj.events(log_dir) if e["kind"] == "recovery_finished"]) >= n
                or proc.poll() is not None, timeout=240)


def _finish(proc: subprocess.Popen, log_dir: Path) -> tuple[str, list[dict]]:
    return dj.digest(dj.finish(proc), dj.LONG_STEPS), dj.events(log_dir)


@pytest.mark.parametrize("mode", ["ft.rank", "env"])
def test_script_that_reads_its_rank_in_set_up(tmp_path: Path, long_reference: str, mode: str) -> None:
    """``ft.rank`` in the set-up: the hot spare waits there, is promoted, finishes its set-up like a
    warm spare, with a warning naming it. ``os.environ["RANK"]``: the hot spare fails in its set-up
    (the variable is absent, never a guess), the node keeps warm spares, with a warning. Both end
    bitwise equal to the fault-free run."""
    log_dir = tmp_path / "logs"
    go = tmp_path / "go"
    stretch = tmp_path / "stretch"  # the job pauses after each step while it exists (until the fault is over)
    stretch.touch()
    proc = _start(tmp_path, f"rank=3,point=allreduce,kind=kill,when={go}", SCRIPTS / "rank_in_setup.py", mode, pause="0.2",
                  pause_while=stretch)
    waiting = "waits for a rank at ft.rank" if mode == "ft.rank" else "KeyError"
    try:
        dj.wait_for(lambda: (log_dir / "spares.log").exists() and waiting in (log_dir / "spares.log").read_text()
                    or proc.poll() is not None, timeout=240)
        if mode == "env":  # the node has seen its hot spare fail, and started a warm one
            dj.wait_for(lambda: [e for e in dj.events(log_dir) if e["detail"].get("fault") == "hot_spare_contract"]
                        or proc.poll() is not None, timeout=240)
        go.touch()
        _wait_recoveries(proc, log_dir, 1)
        stretch.unlink()  # the rest of the job runs at full speed
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    digest, events = _finish(proc, log_dir)
    assert digest == long_reference, dj.story(events)
    dj.assert_survivors_kept_pids(events, {3})
    warnings = [e["message"] for e in events if e["detail"].get("fault") == "hot_spare_contract"]
    assert len(warnings) == 1, dj.story(events)
    respawn = [e["detail"] for e in events if e["kind"] == "rank_started"][4]
    if mode == "ft.rank":
        assert "waiting on ft.rank" in warnings[0] and respawn["hot_spare"]
    else:
        assert "exited with code 1" in warnings[0] and "KeyError" in warnings[0] and respawn["warm_spare"]
        assert not _ready(log_dir)


IN_SETUP = re.compile(r"hot spare \(pid (\d+)\) in its set-up")
#: The faults of the shared job once the hot spares are past their set-up: a kill at each injection
#: point, on rank 0 and on the last rank, each once a fresh hot spare waits at the loop (rank 3
#: already served one fault, so its incarnations start at 1).
FOUR = [(0, "allreduce", 0), (3, "optimizer", 1), (0, "before_forward", 1), (3, "between_steps", 2)]


class SpareJob:
    """The one job of the module's two hot-spare stories (the set-up story, then four faults in a
    row), run once: its processes, what the test saw while driving it, and its end."""

    def __init__(self, digest: str, events: list[dict], in_setup: int, killed: int, ready_in_setup: list[int]) -> None:
        self.digest, self.events = digest, events
        self.in_setup, self.killed, self.ready_in_setup = in_setup, killed, ready_in_setup


def _waiting_spare(log_dir: Path, skip: set[int]) -> int | None:
    """The pid of a hot spare that waits at the training loop now: it said so, serves no rank yet
    and is not in ``skip``."""
    ranks = {e["pid"] for e in dj.events(log_dir) if e["kind"] == "rank_started"}
    for pid in _ready(log_dir):
        if pid not in ranks and pid not in skip:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            return pid
    return None


@pytest.fixture(scope="module")
def spare_job(tmp_path_factory: pytest.TempPathFactory) -> SpareJob:
    """One 4-rank job (slow_spare_setup.py, whose hot spares hold in their set-up while a file
    exists) through six faults and one killed spare, driven in two stories:

    1. Rank 3 is killed while the node's only hot spare holds in its set-up; that
       spare, released, finishes its set-up as rank 3; rank 1 is killed at once after that recovery
       and the node's next spare serves it, ready or not.
    2. A hot spare waiting at the loop is SIGKILLed (the job must not notice); then the four
       faults of :data:`FOUR`, each once a fresh hot spare waits at the loop.

    (Shared so that two stories cost one job; each test below checks its own facts.)
    """
    tmp_path = tmp_path_factory.mktemp("spares")
    log_dir = tmp_path / "logs"
    hold = tmp_path / "hold"
    hold.touch()
    stretch = tmp_path / "stretch"  # the job pauses after each step while it exists (faults are being sent)
    stretch.touch()
    go = [tmp_path / f"go{i}" for i in range(2 + len(FOUR))]
    faults = [f"rank=3,point=allreduce,kind=kill,when={go[0]}", f"rank=1,point=before_forward,kind=kill,when={go[1]}"]
    faults += [f"rank={rank},point={point},kind=kill,incarnation={inc},when={go[2 + i]}"
               for i, (rank, point, inc) in enumerate(FOUR)]
    proc = _start(tmp_path, "; ".join(faults), SCRIPTS / "slow_spare_setup.py", str(hold), pause="0.8",
                  max_restarts=str(len(go) + 2), pause_while=stretch)
    try:
        dj.wait_for(lambda: (log_dir / "spares.log").exists() and IN_SETUP.search((log_dir / "spares.log").read_text())
                    or proc.poll() is not None, timeout=240)
        ready_in_setup = _ready(log_dir)
        in_setup = int(IN_SETUP.search((log_dir / "spares.log").read_text()).group(1))
        go[0].touch()  # rank 3 dies while the only spare holds in its set-up
        dj.wait_for(lambda: len([e for e in dj.events(log_dir) if e["kind"] == "rank_started"]) > 4
                    or proc.poll() is not None, timeout=240)
        hold.unlink()  # the spare finishes its set-up, as rank 3
        _wait_recoveries(proc, log_dir, 1)
        go[1].touch()  # the next fault at once: the node's next spare serves it, ready or not
        _wait_recoveries(proc, log_dir, 2)
        dj.wait_for(lambda: _waiting_spare(log_dir, set()) or proc.poll() is not None, timeout=240)
        killed = _waiting_spare(log_dir, set())
        assert killed is not None, "the job ended before a hot spare waited at the loop"
        os.kill(killed, signal.SIGKILL)  # the spare, waiting at the training loop: the job must not notice
        for i in range(len(FOUR)):
            dj.wait_for(lambda: _waiting_spare(log_dir, {killed}) or proc.poll() is not None, timeout=240)
            go[2 + i].touch()
            _wait_recoveries(proc, log_dir, 3 + i)
        stretch.unlink()  # the faults are over: the rest of the job runs at full speed
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    digest, events = _finish(proc, log_dir)
    return SpareJob(digest, events, in_setup, killed, ready_in_setup)


@pytest.mark.slow  # the module's shared job (six faults, one job): its slowest
def test_spare_job_ends_bitwise_equal_after_its_faults(spare_job: SpareJob, long_reference: str) -> None:
    """Six faults (two in the set-up story, four in a row) and a killed spare: the run ends bitwise
    equal to the fault-free one, by rank respawns alone, each rank restarted once per fault."""
    events = spare_job.events
    assert spare_job.digest == long_reference, dj.story(events)
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [3, 1, 0, 3, 0, 3], dj.story(events)
    dj.assert_survivors_kept_pids(events, {0, 1, 3})
    assert {rank: len(pids) for rank, pids in dj.started(events).items()} == {0: 3, 1: 2, 2: 1, 3: 4}, dj.story(events)
    assert not [e for e in events if e["detail"].get("fault") == "hot_spare_contract"], dj.story(events)


@pytest.mark.slow  # the module's shared job (six faults, one job): its slowest
def test_hot_spares_take_four_faults_in_a_row(spare_job: SpareJob) -> None:
    """A hot spare killed while it waits is replaced unnoticed; then a kill at each injection point,
    on rank 0 and on the last rank, each once a hot spare waits at the loop: four faults, four
    promoted hot spares (the job's end: the test above)."""
    events = spare_job.events
    failed = [e["rank"] for e in events if e["kind"] == "rank_failed"][2:]
    assert failed == [rank for rank, _, _ in FOUR], dj.story(events)
    respawns = [e["detail"] for e in events if e["kind"] == "rank_started"][6:]
    assert len(respawns) == 4 and all(d["hot_spare"] for d in respawns), dj.story(events)
    assert spare_job.killed not in [e["pid"] for e in events if e["kind"] == "rank_started"]


@pytest.mark.slow  # the module's shared job (six faults, one job): its slowest
def test_a_fault_while_the_hot_spare_is_in_its_set_up_is_served_by_it(spare_job: SpareJob) -> None:
    """A fault that comes while the node's hot spare is still in the script's
    set-up is given to that spare (it finishes its set-up as the rank), never to a new process; the
    fault right after it is served by the next spare. Before, a brand-new process took the rank."""
    events = spare_job.events
    assert not spare_job.ready_in_setup, "a hot spare was ready while the only spare held in its set-up"
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"][:2] == [3, 1], dj.story(events)
    respawns = [e for e in events if e["kind"] == "rank_started"][4:6]
    assert len(respawns) == 2 and all(e["detail"]["hot_spare"] for e in respawns), dj.story(events)
    assert respawns[0]["pid"] == spare_job.in_setup, dj.story(events)

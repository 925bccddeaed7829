"""Hot spares (issue 13): spares past the script's set-up, promoted to a failed rank's identity.

Each job trains the 4-rank digits job for LONG_STEPS steps, stretched by ``--step_pause`` (a sleep:
same result, little CPU), and must end bitwise equal to the fault-free run. Faults fire at named
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


def _start(tmp_path: Path, fault: str, script: Path = dj.SCRIPT, *script_args: str, pause: str = "0.4") -> subprocess.Popen:
    cmd = dj.cmd(tmp_path / "logs", dj.LONG_STEPS)
    at = cmd.index(str(dj.SCRIPT))
    cmd = [*cmd[:at], "--hot_spares", "1", str(script), *script_args, *cmd[at + 1:], "--step_pause", pause]
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
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return dj.digest(out, dj.LONG_STEPS), dj.events(log_dir)


def test_hot_spares_take_four_faults_in_a_row(tmp_path: Path, long_reference: str) -> None:
    """A hot spare killed while it waits is replaced unnoticed; then a kill at each injection point,
    on rank 0 and on the last rank, each once a hot spare waits at the loop: four faults, four
    promoted hot spares, and the run ends bitwise equal to the fault-free one."""
    log_dir = tmp_path / "logs"
    points = [(0, "allreduce"), (3, "optimizer"), (0, "before_forward"), (3, "between_steps")]
    fault = "; ".join(f"rank={rank},point={point},kind=kill,incarnation={i // 2},when={tmp_path / f'go{i}'}"
                      for i, (rank, point) in enumerate(points))
    proc = _start(tmp_path, fault)
    try:
        dj.wait_for(lambda: _ready(log_dir), timeout=240)
        killed = _ready(log_dir)[0]
        os.kill(killed, signal.SIGKILL)  # the spare, waiting at the training loop: the job must not notice
        for i in range(len(points)):
            dj.wait_for(lambda: len(_ready(log_dir)) >= i + 2 or proc.poll() is not None, timeout=240)
            (tmp_path / f"go{i}").touch()
            _wait_recoveries(proc, log_dir, i + 1)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    digest, events = _finish(proc, log_dir)
    assert digest == long_reference, dj.story(events)
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [0, 3, 0, 3], dj.story(events)
    dj.assert_survivors_kept_pids(events, {0, 3})
    respawns = [e["detail"] for e in events if e["kind"] == "rank_started"][4:]
    assert len(respawns) == 4 and all(d["hot_spare"] for d in respawns), dj.story(events)
    assert not [e for e in events if e["detail"].get("fault") == "hot_spare_contract"], dj.story(events)
    assert killed not in [e["pid"] for e in events if e["kind"] == "rank_started"]


@pytest.mark.parametrize("mode", ["ft.rank", "env"])
def test_script_that_reads_its_rank_in_set_up(tmp_path: Path, long_reference: str, mode: str) -> None:
    """``ft.rank`` in the set-up: the hot spare waits there, is promoted, finishes its set-up like a
    warm spare, with a warning naming it. ``os.environ["RANK"]``: the hot spare fails in its set-up
    (the variable is absent, never a guess), the node keeps warm spares, with a warning. Both end
    bitwise equal to the fault-free run."""
    log_dir = tmp_path / "logs"
    go = tmp_path / "go"
    proc = _start(tmp_path, f"rank=3,point=allreduce,kind=kill,when={go}", SCRIPTS / "rank_in_setup.py", mode, pause="0.1")
    waiting = "waits for a rank at ft.rank" if mode == "ft.rank" else "KeyError"
    try:
        dj.wait_for(lambda: (log_dir / "spares.log").exists() and waiting in (log_dir / "spares.log").read_text()
                    or proc.poll() is not None, timeout=240)
        if mode == "env":  # the node has seen its hot spare fail, and started a warm one
            dj.wait_for(lambda: [e for e in dj.events(log_dir) if e["detail"].get("fault") == "hot_spare_contract"]
                        or proc.poll() is not None, timeout=240)
        go.touch()
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


@pytest.mark.slow
def test_a_fault_while_the_hot_spare_is_in_its_set_up_is_served_by_it(tmp_path: Path, long_reference: str) -> None:
    """Issue 24 item 4: a fault that comes while the node's hot spare is still in the script's
    set-up is given to that spare (it finishes its set-up as the rank), never to a new process; the
    fault right after it is served by the next spare. Before, a brand-new process took the rank."""
    log_dir = tmp_path / "logs"
    hold = tmp_path / "hold"
    hold.touch()
    go = [tmp_path / "go0", tmp_path / "go1"]
    fault = (f"rank=3,point=allreduce,kind=kill,when={go[0]}; "
             f"rank=1,point=before_forward,kind=kill,when={go[1]}")
    proc = _start(tmp_path, fault, SCRIPTS / "slow_spare_setup.py", str(hold))
    try:
        dj.wait_for(lambda: (log_dir / "spares.log").exists() and IN_SETUP.search((log_dir / "spares.log").read_text())
                    or proc.poll() is not None, timeout=240)
        assert not _ready(log_dir)
        in_setup = int(IN_SETUP.search((log_dir / "spares.log").read_text()).group(1))
        go[0].touch()  # rank 3 dies while the only spare holds in its set-up
        dj.wait_for(lambda: len([e for e in dj.events(log_dir) if e["kind"] == "rank_started"]) > 4
                    or proc.poll() is not None, timeout=240)
        hold.unlink()  # the spare finishes its set-up, as rank 3
        _wait_recoveries(proc, log_dir, 1)
        go[1].touch()  # the next fault at once: the node's next spare serves it, ready or not
        _wait_recoveries(proc, log_dir, 2)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    digest, events = _finish(proc, log_dir)
    assert digest == long_reference, dj.story(events)
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [3, 1], dj.story(events)
    dj.assert_survivors_kept_pids(events, {3, 1})
    respawns = [e for e in events if e["kind"] == "rank_started"][4:]
    assert len(respawns) == 2 and all(e["detail"]["hot_spare"] for e in respawns), dj.story(events)
    assert respawns[0]["pid"] == in_setup, dj.story(events)
    assert not [e for e in events if e["detail"].get("fault") == "hot_spare_contract"], dj.story(events)

"""examples/deploy/ftrun.sbatch on a real Slurm cluster (tests/slurmcluster.py: slurmctld and three
slurmd, each node a network-namespace host), submitted with ``sbatch`` as a user would.

The job is the digits job of tests/digits_job.py: 2 training nodes x 2 ranks (the 4 ranks of the
``reference`` run) and the script's spare node. Its correctness bar is the single-node one: the
final parameters equal the fault-free run's, bitwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import digits_job as dj
import pytest
import slurmcluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "deploy" / "ftrun.sbatch"
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE")


@pytest.fixture(scope="module")
def slurm():
    """One Slurm cluster for the module (controller + sn1..sn3); skips where Slurm cannot run here."""
    reason = slurmcluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = slurmcluster.SlurmCluster(3)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(slurm):
    """The module's cluster with every node up and idle before the test (a test may kill a node)."""
    for host in slurm.hosts:
        subprocess.run(["ip", "link", "set", host.veth, "up"], check=True)
    for name, host in slurm.nodes.items():
        if not host.pids():
            slurm.start_slurmd(name)
    slurm.wait_nodes("idle", list(slurm.nodes), timeout=60)
    yield slurm
    out = slurm.cmd(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
    for job in out:
        slurm.cmd(["scancel", job], timeout=30)


class Job:
    """One submitted batch job: its id, its output file, node 0's log directory."""

    def __init__(self, cluster: slurmcluster.SlurmCluster, job_id: str, cwd: Path) -> None:
        self.cluster = cluster
        self.id = job_id
        self.cwd = cwd
        self.out = cwd / f"ftrun-{job_id}.out"
        self.log_dir = cwd / "ftrun_logs" / job_id

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def events(self) -> list[dict]:
        return dj.events(self.log_dir)

    def state(self) -> str:
        return self.cluster.job_state(self.id)

    def wait(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.state()) not in FINISHED:
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id} still {state} after {timeout:g} s\n{self.output()[-4000:]}\n"
                            f"{dj.story(self.events())}")
            time.sleep(0.5)
        return state

    def why(self) -> str:
        return f"{self.output()[-5000:]}\n--- events\n{dj.story(self.events())}\n--- slurm\n{self.cluster.logs()}"


def submit(cluster: slurmcluster.SlurmCluster, cwd: Path, steps: str, sbatch_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None, script_args: tuple[str, ...] = ()) -> Job:
    cwd.mkdir(parents=True, exist_ok=True)
    environ = dj.env({"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                      "PYTHONUNBUFFERED": "1", "FTRUN_LOCAL_WORKER_NUM": "2",
                      **(env or {})})
    proc = cluster.cmd(["sbatch", "--parsable", *sbatch_args, str(SBATCH), str(dj.SCRIPT), "--steps", steps,
                        "--log_every", "10", *script_args], cwd=cwd, env=environ, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    assert re.fullmatch(r"\d+", job_id), proc.stdout
    return Job(cluster, job_id, cwd)


def test_sbatch_trains_to_the_fault_free_digest(cluster, reference: str, tmp_path: Path) -> None:
    job = submit(cluster, tmp_path, dj.STEPS)
    state = job.wait()
    assert state == "COMPLETED", job.why()
    assert dj.digest(job.output(), dj.STEPS) == reference, job.why()
    events = job.events()
    assert {e["detail"].get("node") for e in events if e["kind"] == "rank_started"} == {0, 1}, job.why()
    assert not [e for e in events if e["kind"] in ("rank_failed", "recovery_started", "job_restarting")], job.why()


def kill_node(cluster: slurmcluster.SlurmCluster, name: str) -> float:
    """SIGKILL every process of node ``name`` (its slurmd, slurmstepd, ftrun and ranks): a dead
    machine. Its link goes down first, so that nothing it sends while dying (a launcher's goodbye,
    the kernel's FIN of a killed process's sockets) reaches anyone: the others learn of the loss by
    silence, as from a machine that lost power; the ``cluster`` fixture brings it up again. Returns the
    wall-clock time of the kill."""
    host = cluster.nodes[name]
    subprocess.run(["ip", "link", "set", host.veth, "down"], check=True)
    at = time.time()
    deadline = time.monotonic() + 30
    while pids := host.pids():
        assert time.monotonic() < deadline, f"processes of {name} survive SIGKILL: {pids}"
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return at


def test_lost_node_is_replaced_by_the_spare(cluster, long_reference: str, tmp_path: Path) -> None:
    """Every process of training node 1's host is killed, slurmd included; the script's spare
    takes node 1's index; the job ends with the fault-free digest, node 0's ranks keep their PIDs."""
    job = submit(cluster, tmp_path, dj.LONG_STEPS)
    dj.wait_for(lambda: job.state() in FINISHED or dj.training(job.log_dir), timeout=240)
    assert dj.training(job.log_dir), job.why()
    # Which host is node 1 is decided at start (the spare may have come first): the one that runs rank 2.
    rank2 = dj.started(job.events())[2][0]
    victim = next(name for name, host in cluster.nodes.items() if rank2 in host.pids())
    assert victim != "sn1", "node 1's rank runs on node 0's host"
    lost_at = kill_node(cluster, victim)
    state = job.wait(timeout=200)
    events = job.events()
    assert dj.digest(job.output(), dj.LONG_STEPS) == long_reference, job.why()
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert [e["detail"].get("node_lost") for e in lost] == [1], job.why()
    joined = [e for e in events if e["kind"] == "node_joined" and e["detail"].get("replacement")]
    assert joined, job.why()
    pids = dj.started(events)
    assert len(pids[0]) == 1 and len(pids[1]) == 1, f"a rank of node 0 was restarted\n{job.why()}"
    assert len(pids[2]) == 2 and len(pids[3]) == 2, job.why()
    assert not [e for e in events if e["kind"] == "job_restarting"], job.why()
    finished = [e for e in events if e["kind"] == "recovery_finished" and e["time"] > lost_at]
    assert finished, job.why()
    print(f"slurm: node lost -> node_lost {lost[0]['time'] - lost_at:.2f} s, -> replacement joined "
          f"{joined[0]['time'] - lost_at:.2f} s, -> training again {finished[0]['time'] - lost_at:.2f} s; job {state}")
    assert state == "COMPLETED", job.why()


def stop_and_resume(cluster: slurmcluster.SlurmCluster, tmp_path: Path, reference: str, stop, steps: str,
                    sbatch_args: tuple[str, ...] = (), script_args: tuple[str, ...] = ()) -> Job:
    """Submit the job, let ``stop(job)`` stop it once it trains, check its dying-gasp checkpoint,
    and submit it again with the same FTRUN_CHECKPOINT_DIR: it resumes and ends with ``reference``."""
    ckpt = tmp_path / "ckpt"
    job = submit(cluster, tmp_path / "first", steps, sbatch_args, env={"FTRUN_CHECKPOINT_DIR": str(ckpt)},
                 script_args=script_args)
    dj.wait_for(lambda: job.state() in FINISHED or dj.training(job.log_dir), timeout=240)
    assert dj.training(job.log_dir), job.why()
    stop(job)
    state = job.wait(timeout=240)
    events = job.events()
    gasp = [e for e in events if e["kind"] == "checkpoint_saved" and "dying gasp" in e["message"]]
    assert gasp, f"{state}: no dying-gasp checkpoint\n{job.why()}"
    assert not [e for e in events if e["kind"] == "rank_failed"], job.why()  # no rank died before the save
    assert state == "FAILED", job.why()  # ftrun's exit code 143 (stopped by SIGTERM)
    again = submit(cluster, tmp_path / "again", steps, env={"FTRUN_CHECKPOINT_DIR": str(ckpt)})
    assert again.wait(timeout=240) == "COMPLETED", again.why()
    assert "starting from checkpoint" in again.output(), again.why()
    assert dj.digest(again.output(), steps) == reference, again.why()
    return job


def test_scancel_saves_a_dying_gasp_and_the_job_resumes(cluster, long_reference: str, tmp_path: Path) -> None:
    """``scancel --batch --signal=USR1`` (the script's stop signal): node 0's ftrun writes a
    dying-gasp checkpoint from live ranks; the re-submitted job resumes from it, bitwise."""
    def stop(job: Job) -> None:
        proc = cluster.cmd(["scancel", "--batch", "--signal=USR1", job.id], timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    stop_and_resume(cluster, tmp_path, long_reference, stop, dj.LONG_STEPS)


def test_time_limit_warning_saves_a_dying_gasp_and_the_job_resumes(cluster, long_reference: str,
                                                                   tmp_path: Path) -> None:
    """A job that would train for over 90 s, submitted with a 3-minute limit and
    ``--signal=B:USR1@90`` (the script's own is 120 s): once it trains, its limit is cut
    (``scontrol update TimeLimit``) to the next whole minute at least 60 s away, so the warning is
    due at once. Slurm's time-limit check (every 30 s) sends the script's USR1 -- never less than
    60 s before the limit -- node 0's ftrun saves a dying gasp before the kill (the job ends FAILED
    with ftrun's 143, not TIMEOUT), and the job submitted again resumes, bitwise. Cutting the limit
    once training runs, rather than submitting a shorter one, makes the warning come after training
    started however slowly the job starts, without waiting out a 3-minute limit (it took 117 s)."""
    def cut_the_limit(job: Job) -> None:
        out = cluster.cmd(["scontrol", "-o", "show", "job", job.id], timeout=30).stdout
        run_time = re.search(r"\bRunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", out)
        assert run_time, out
        days, hours, minutes, seconds = (int(g or 0) for g in run_time.groups())
        elapsed = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
        limit = elapsed // 60 + 2  # minutes from the start: 60 to 120 s from now, the warning due
        proc = cluster.cmd(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={limit}"], timeout=30)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    job = stop_and_resume(cluster, tmp_path, long_reference, cut_the_limit, dj.LONG_STEPS,
                          sbatch_args=("--time=3", "--signal=B:USR1@90"), script_args=("--step_pause", "0.6"))
    stopped = [e for e in job.events() if e["kind"] == "stop_requested"]
    assert len(stopped) == 1 and "SIGTERM" in stopped[0]["message"], job.why()

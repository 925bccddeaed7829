"""examples/deploy/ftrun.sbatch on a real Slurm cluster (tests/slurmcluster.py: slurmctld and three
slurmd, each node a network-namespace host), submitted with ``sbatch`` as a user would.

The job is the digits job of tests/digits_job.py: 2 training nodes x 2 ranks (the 4 ranks of the
``reference`` run) and the script's spare node. Its correctness bar is the single-node one: the
final parameters equal the fault-free run's, bitwise.
"""

from __future__ import annotations

import os
import re
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
    slurm.restore()
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

    def restarts(self) -> int:
        """How many times the job was requeued (``Restarts=`` of ``scontrol show job``)."""
        out = self.cluster.cmd(["scontrol", "-o", "show", "job", self.id], timeout=30).stdout
        match = re.search(r"\bRestarts=(\d+)", out)
        assert match, out
        return int(match.group(1))

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
    lost_at = cluster.kill_node(victim)
    state = job.wait(timeout=200)
    cluster.end_steps_on(victim)  # its srun client, still waiting for the dead host, is not the job's
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


def dying_gasps(job: Job, since: float = 0.0) -> list[dict]:
    """The job's dying-gasp ``checkpoint_saved`` events after ``since`` (wall clock)."""
    return [e for e in job.events() if e["kind"] == "checkpoint_saved" and "dying gasp" in e["message"]
            and e["time"] > since]


def assert_stopped_with_a_gasp(job: Job, state: str, since: float = 0.0) -> None:
    """The run of ``job`` that ended in ``state`` wrote a dying gasp from live ranks and exited 143."""
    assert dying_gasps(job, since), f"{state}: no dying-gasp checkpoint\n{job.why()}"
    failed = [e for e in job.events() if e["kind"] == "rank_failed" and e["time"] > since]
    assert not failed, job.why()  # no rank died before the save
    assert state == "FAILED", job.why()  # ftrun's exit code 143 (stopped by SIGTERM)


def cut_the_limit(cluster: slurmcluster.SlurmCluster, job: Job) -> None:
    """Cut the running job's time limit to the next whole minute at least 60 s away (its RunTime
    counts from this run's start): with ``--signal=B:USR1@90`` the warning is due at once."""
    out = cluster.cmd(["scontrol", "-o", "show", "job", job.id], timeout=30).stdout
    run_time = re.search(r"\bRunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", out)
    assert run_time, out
    days, hours, minutes, seconds = (int(g or 0) for g in run_time.groups())
    elapsed = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    limit = elapsed // 60 + 2  # minutes from the start: 60 to 120 s from now, the warning due
    proc = cluster.cmd(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={limit}"], timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dying_gasps_then_requeue_and_resubmission_resume(cluster, long_reference: str, tmp_path: Path) -> None:
    """Both ways Slurm stops a job, each answered with a dying gasp, and both ways to run it again,
    ending bitwise equal to the fault-free run:

    1. ``scancel --batch --signal=USR1`` (the script's stop signal) once the job trains: node 0's
       ftrun writes a dying-gasp checkpoint from live ranks; the job ends FAILED (ftrun's 143).
    2. ``scontrol requeue``: the same job id runs the batch script again (``Restarts=1``, after
       ``cred_expire``), so the script's default FTRUN_CHECKPOINT_DIR is the same and it resumes.
    3. That run's time limit is cut once it trains: Slurm's time-limit check (every 30 s) sends
       ``--signal=B:USR1@90`` -- never less than 60 s before the limit -- and node 0's ftrun saves
       a second dying gasp before the kill (FAILED, not TIMEOUT). Cutting the limit once training
       runs, rather than submitting a shorter one, makes the warning come after training started
       however slowly the job starts (``--step_pause 0.5``: it still trains for over 60 s after
       its first logged step, more than the 30 s between Slurm's checks).
    4. A new job submitted with that FTRUN_CHECKPOINT_DIR resumes and runs to the end.
    """
    clock = time.monotonic()
    phases: list[str] = []  # how long each phase took, printed at the end (seconds)

    def phase(name: str) -> None:
        nonlocal clock
        phases.append(f"{name} {time.monotonic() - clock:.0f}")
        clock = time.monotonic()

    job = submit(cluster, tmp_path, dj.LONG_STEPS, ("--time=10", "--signal=B:USR1@90"),
                 script_args=("--step_pause", "0.5"))
    ckpt = job.cwd / "ftrun_checkpoints" / job.id  # the script's default, from the job id

    def trains() -> bool:  # every rank connected, rank 0 logged step 10 (so steps are committed)
        return len({e["rank"] for e in job.events() if e["kind"] == "rank_joined"}) == 4 and \
            bool(re.search(r"\[rank0\] step [1-9]\d* loss", job.output()))

    dj.wait_for(lambda: job.state() in FINISHED or trains(), timeout=240)
    assert trains(), job.why()
    phase("trains")
    proc = cluster.cmd(["scancel", "--batch", "--signal=USR1", job.id], timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_stopped_with_a_gasp(job, job.wait(timeout=240))
    phase("scancel->FAILED")
    stopped = [e for e in job.events() if e["kind"] == "stop_requested"]
    assert len(stopped) == 1, job.why()

    first_output = job.output()
    proc = cluster.cmd(["scontrol", "requeue", job.id], timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    requeued_at, requeued_clock = time.time(), time.monotonic()
    assert job.restarts() == 1, job.why()

    def trains_again() -> bool:  # rank 0 logs a step after resuming from the checkpoint
        after = job.output().partition(f"starting from checkpoint {ckpt}")[2]
        return bool(re.search(r"\[rank0\] step \d+ loss", after))

    dj.wait_for(lambda: job.state() in FINISHED or trains_again(), timeout=240)
    assert trains_again(), job.why()
    phase("requeue->trains")
    shown = cluster.cmd(["scontrol", "-o", "show", "job", job.id], timeout=30).stdout
    times = " ".join(re.findall(r"\b(?:SubmitTime|EligibleTime|StartTime)=\S+", shown))
    kept = "appended to" if job.output().startswith(first_output) else "overwrote"
    print(f"slurm: requeued job {job.id}: trains again {time.monotonic() - requeued_clock:.1f} s after the "
          f"requeue; its output {kept} the first run's; {times}")
    cut_the_limit(cluster, job)
    assert_stopped_with_a_gasp(job, job.wait(timeout=240), since=requeued_at)
    phase("limit cut->FAILED")
    stopped = [e for e in job.events() if e["kind"] == "stop_requested" and e["time"] > requeued_at]
    assert len(stopped) == 1 and "SIGTERM" in stopped[0]["message"], job.why()

    again = submit(cluster, tmp_path / "again", dj.LONG_STEPS, env={"FTRUN_CHECKPOINT_DIR": str(ckpt)})
    assert again.wait(timeout=240) == "COMPLETED", again.why()
    assert f"starting from checkpoint {ckpt}" in again.output(), again.why()
    assert dj.digest(again.output(), dj.LONG_STEPS) == long_reference, again.why()
    phase("re-submitted->COMPLETED")
    print(f"slurm: phases (s): {', '.join(phases)}")

"""ftrun against torchrun: recovery time, where it goes, steady-state overhead, scaling and memory.

    python scripts/bench.py                      # everything, moderate sizes (about 30 min on 2 cores)
    python scripts/bench.py --quick              # a smoke run of every part (a few minutes)
    python scripts/bench.py --parts recovery --repeats 5
    python scripts/bench.py --parts multinode --repeats 3   # 2 hosts x 2 ranks (network namespaces, root)
    python scripts/bench.py --parts nodeloss --repeats 2    # a whole host lost, a replacement on a third
    python scripts/bench.py --parts nodeloss --standby --repeats 2   # ... a standby node with hot spares on the third
    python scripts/bench.py --parts elastic --repeats 2     # --nnodes 2:3, a host lost and none replacing it
    python scripts/bench.py --parts fsdp --repeats 3        # HSDP 2x2 (FSDP2): recovery and fault-free step time
    python scripts/bench.py --from_json results.json --plots docs   # tables and figures again

Every case runs the same job under both launchers:

- ftrun (ARF): ``examples/train_digits.py`` or ``examples/train_charlm.py`` with the worker library;
  only the killed rank is respawned and it pulls the state from a replica.
- torchrun: the plain-DDP twin (``train_digits_torchrun.py``, ``train_charlm_torchrun.py``) with
  ``--max-restarts 1 --standalone`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its default shared
  store cannot restart a gloo job after a SIGKILL in torch 2.13: pytorch issues 135712, 167288);
  rank 0 checkpoints every ``ckpt_every`` steps and every rank resumes from the file.

Rank 0 prints ``step N loss L time T`` after every step with its own clock. When it prints the kill
step, this script SIGKILLs the victim rank from outside (no help from any library) and records:

- failed_step: the first step the job could not finish because of the kill;
- recover_s: from the kill to rank 0 finishing the failed step (the step counter passing it again);
- recomputed: steps executed twice (torchrun resumes at its last checkpoint, ftrun at the first
  uncommitted step);
- total_s: wall time of the whole job; step_s: the median step interval away from the fault;
- for ftrun, recover_s split (from ``events.jsonl`` and the step clock) into detection (kill to the
  supervisor seeing the death), respawn (process start and imports until the new rank says hello),
  setup (the new rank's own start-up: data, model, until it enters recovery), rebuild (the new
  process group), transfer (state, point to point), retried (the failed step run again) and other;
  for torchrun into restart (kill to the first step after the restart) and recompute;
- peak resident memory (VmHWM) of the launcher, of ftrun's supervisor, of the largest rank, of
  ftrun's fork server and of a warm spare where one runs (``--fork_server off``; once promoted to
  replace the killed rank, it keeps its command line).

The ``multinode`` part runs the digits job on 2 hosts x 2 ranks: two Linux network namespaces on
a bridge (``tests/nethosts.py``; needs root, else the part is skipped with one line), one launcher
per host, and SIGKILLs rank 3 (on host 1). ftrun: ``--worker_num 4 --local_worker_num 2
--node_rank i --master_addr <host 0>`` and a shared ``FTRUN_TOKEN``; it picks the data-plane
interface itself. torchrun: ``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint
<host 0>:29400 --rdzv-conf is_host=1|0 --local-addr <host i> --max-restarts 1`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and ``GLOO_SOCKET_IFNAME=eth0``: without any one of these
torchrun could not start or restart the job across the hosts (the host name resolves to 127.0.0.1
inside a namespace; docs/benchmarks.md says what each omission did). The checkpoint directory is
shared (both hosts are one machine: a shared file system). One fault-free run of each launcher
first gives the reference ``params_sha256`` of each; a failed run's logs are kept (the path is in
its error).

The ``nodeloss`` part runs the same 2 x 2 job on 3 hosts, host 2 idle. When rank 0 prints the
kill step, every process in host 1's namespace (its launcher and ranks 2 and 3) is SIGKILLed and a
replacement launcher with the same command and node index 1 is started at once on host 2 (what a
Kubernetes or Slurm restart of the pod would do, without its scheduling delay; the replacement's
start-up is inside recover_s). ftrun adds ``--node_wait_timeout 120 --max_restarts 4``; torchrun's
replacement agent uses host 2's ``--local-addr``. For ftrun recover_s is split from node 0's
events.jsonl into detection (kill to node_lost), join (to the replacement's node_joined), recovery
(to recovery_finished) and the retried step; which ranks kept their pid is recorded.

The ``elastic`` part runs the digits job on 3 hosts x 2 ranks as an elastic job (``--nnodes 2:3``)
and, when rank 0 prints the kill step, SIGKILLs every process of host 2; no launcher replaces it.
ftrun (``--replace_timeout 3``) starts ranks 4 and 5 on hosts 0 and 1, the same 6 ranks; torchrun
(``--nnodes 2:3``, ``--rdzv-conf last_call_timeout=1``: its fastest re-rendezvous) restarts every
worker on the 2 hosts left, a world of 4, from its checkpoint. recover_s is the time from the kill
to the failed step trained again; ftrun's is split from node 0's events into detection (kill to
node_lost), wait (to job_shrunk: ``--replace_timeout``) and recovery (to recovery_finished).

The ``fsdp`` part runs the sharded GPT of ``examples/train_fsdp.py`` (FSDP2 on an HSDP mesh,
``--mesh 2,2``: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1) on 4 ranks, against its twin
``train_fsdp_torchrun.py``, which has no checkpoint: torchrun's restart starts every rank again
from step 0, so the steps redone are in its recover_s (split into restart, the kill to the first
step after the restart, and recompute). Each repeat runs a fault-free pair and a pair with rank 3
SIGKILLed from outside when rank 0 prints step ``--fsdp_steps / 2``, the launchers' order
alternating from one repeat to the next. It reports the recovery pair by pair, with the figures of
ftrun's ``recovery_finished`` event; the wall time each launcher lost (the faulted run's span from
the first step line to the last against the same launcher's fault-free span in the same repeat);
each final ``params_sha256`` against the fault-free runs'; and the fault-free step times' ratio,
with the CPU a step of a rank's process (psutil, every thread, from step 3 to the last), which a
shared machine's load changes less than the wall time.

With ``--standby`` the third host runs, for ftrun, a launcher started before the loss (the same
command without ``--node_rank``, as soon as every node has joined: a standby node, which runs one
hot spare per local rank), and the kill comes at the first step from ``kill_step`` on at which
both of its spares wait at the training loop; nothing is started at the kill. torchrun has no
standby: its replacement agent starts at the kill, as without the flag. The job is longer (1200
steps, the kill from step 300 on) so that the spares are ready before it ends on a loaded machine.

Ratios (torchrun/ftrun recovery, ftrun/torchrun step time) are taken pair by pair: each repeat runs
both launchers back to back, so load on the machine hits both alike. ``--json`` keeps every raw run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step (\d+) loss \S+ time (\d+\.\d+)")
CPU = re.compile(r"step (\d+) loss \S+ time \d+\.\d+ cpu (\d+\.\d+)")  # word_lm: rank 0's training thread, CPU s
# digits/charlm print a test accuracy, the sharded GPT (fsdp) none: group 2 is then None
FINAL = re.compile(r"final step=(\d+) loss=\S+(?: test_accuracy=(\S+))? params_sha256=([0-9a-f]{64})")
STATE_MB = re.compile(r"state_mb=(\S+)")
SPARE_READY = re.compile(r"warm spare \(pid \d+\) ready at (\d+\.\d+)")
LAUNCHERS = ("ftrun", "torchrun")
PARTS = ("recovery", "scaling-world", "scaling-state", "overhead", "overhead-real", "memory", "transfer", "multinode", "elastic",
         "nodeloss", "hf", "fsdp")
DEFAULT_REPEATS = {"recovery": 2, "overhead": 2, "overhead-real": 3, "multinode": 3, "nodeloss": 2, "elastic": 2, "hf": 2,
                   "fsdp": 2}
# hf: Hugging Face Trainer (examples/hf_trainer.py) with ftrun's integration (FTTrainer: a rank-level
# recovery), the same script without it under ftrun (plain Trainer: a whole-job restart that resumes
# from the Trainer's newest checkpoint, ftrun.integrations.hf_resume) and under torchrun (the same)
PART_LAUNCHERS = {"hf": ("ftrun", "ftrun-restart", "torchrun")}
ALTERNATING = {"fsdp"}
"""Parts whose launchers run in turn first: the order of each pair flips from one repeat to the next."""
"""Runs of each case per launcher when --repeats is not given (other parts: --scaling_repeats)."""
RDZV_PORT = 29400  # torchrun's c10d rendezvous on host 0 (a fresh namespace: every port is free)
FTRUN_PORT = 29500  # ftrun's store on host 0
WARMUP_STEPS = 3
SCRIPTS = {
    ("digits", "ftrun"): "train_digits.py",
    ("digits", "torchrun"): "train_digits_torchrun.py",
    ("charlm", "ftrun"): "train_charlm.py",
    ("charlm", "torchrun"): "train_charlm_torchrun.py",
    ("wordlm", "ftrun"): "word_lm.py",
    ("wordlm", "torchrun"): "word_lm_torchrun.py",
    ("hf", "ftrun"): "hf_trainer.py",
    ("hf", "ftrun-restart"): "hf_trainer.py",
    ("hf", "torchrun"): "hf_trainer.py",
    ("fsdp", "ftrun"): "train_fsdp.py",
    ("fsdp", "torchrun"): "train_fsdp_torchrun.py",
}
# Twins with no checkpoint flags: torchrun's restart begins again at step 0 (fsdp), or no fault (wordlm).
NO_CHECKPOINT = ("wordlm", "fsdp")
# fsdp's job: HSDP, 2 replica groups of 2 sharding ranks (fsdp_common's small GPT at its default sizes).
FSDP_ARGS = ("--mesh", "2,2")
FSDP_STEPS = 200
# charlm's flags in every case that runs it: short windows, small batches, a short evaluation.
CHARLM_SMALL = ("--batch_size", "4", "--context", "64", "--eval_windows", "8")
# word_lm's sizes: its defaults (small steps), and a larger LSTM on longer sequences.
WORDLM_SIZES = {"small": (), "large": ("--emsize", "128", "--nhid", "128", "--bptt", "35", "--batch_size", "8")}


@dataclass(frozen=True)
class Case:
    """One job: a workload at one size on ``ranks`` ranks, killed at ``kill_step`` (None: no fault).

    ``args`` are extra script flags; ``ckpt_every`` is torchrun's checkpoint interval in steps.
    """

    workload: str  # "digits", "charlm", "wordlm", "hf" or "fsdp"
    size: str  # charlm size name; "-" for digits
    ranks: int
    steps: int
    kill_step: int | None
    victim: int = 1
    ckpt_every: int = 25
    args: tuple[str, ...] = ()
    nodes: int = 1  # > 1: one launcher per test host (network namespace), ranks // nodes ranks each
    # ftrun with --hot_spares 1, the kill once the hot spare waits at the loop; nodeloss: a standby
    # node (its hot spares) on the third host before the loss, the kill once its spares wait at the loop
    hot: bool = False
    lost_node: int | None = None  # nodeloss: the node whose host is killed (None: the last one)
    # with hot: the kill at kill_step whatever the hot spare's state (a fault while it is still in
    # the script's set-up: it must be served by the spare, never slower than a new process)
    early: bool = False
    elastic: bool = False  # nodeloss as an elastic job (--nnodes N-1:N): no replacement; the others go on

    def label(self) -> str:
        return _label((self.workload, self.size, self.ranks, self.nodes, self.hot, self.lost_node, self.early)) + (
            " elastic" if self.elastic else "")


@dataclass
class Run:
    """What one job measured (times in seconds, memory in MB). Fault fields are None without a fault."""

    launcher: str
    case: Case
    total_s: float
    step_s: float | None
    state_mb: float | None = None
    final: str | None = None
    failed_step: int | None = None
    recover_s: float | None = None
    recomputed: int | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    victim_node: int | None = None  # multinode: the node (host) the killed rank ran on
    exit_codes: list[int] = field(default_factory=list)  # multinode: each node's launcher
    pids: dict[str, Any] = field(default_factory=dict)  # nodeloss: rank pids before the kill and after recovery
    first_epoch_s: float | None = None  # wordlm: the median step of the first epoch (step_s leaves it out)
    cpu_s: float | None = None  # wordlm: the median CPU time of rank 0's training thread a step, in the steady state
    # wordlm: the first step of the steady state: after the first epoch, and (ftrun) once its warm spare's imports
    # ended; a torchrun run takes its ftrun pair's, so both are measured over the same steps
    steady_from: int | None = None
    spare_window_s: float | None = None  # wordlm: the median step after the first epoch, before steady_from
    span_s: float | None = None  # from rank 0's first step line to its last (its clock): training's wall time, start-up left out
    # fsdp, fault-free: CPU seconds a step of a rank's process (every thread, user + system), the mean over the
    # ranks, from step WARMUP_STEPS to the last (less sensitive than step_s to the load of a shared machine)
    rank_cpu_s: float | None = None


# ------------------------------------------------------------------------------------------ running
def command(launcher: str, case: Case, workdir: Path) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, script file name) of ``case`` under ``launcher``."""
    script = SCRIPTS[(case.workload, launcher)]
    if case.workload == "hf":
        env = _base_env()
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # what torchrun needs to restart at all (see above)
        return hf_command(launcher, case, workdir), env, script
    if case.workload == "wordlm":  # steps: its epochs; no fault, so torchrun needs no checkpoints
        common = [str(ROOT / "examples" / script), "--epochs", str(case.steps), "--step-times", *WORDLM_SIZES[case.size],
                  *case.args]
    else:
        common = [str(ROOT / "examples" / script), "--steps", str(case.steps), "--log_every", "1", *case.args]
    if case.workload == "charlm":
        common += ["--size", case.size]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if launcher == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(case.ranks), "--master_port", "0", "--plain",
               "--tail_worker_log", "0", "--log_dir", str(workdir / "logs"), "--max_restarts", "1",
               *(["--hot_spares", "1"] if case.hot else []), *common]
    else:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case.ranks),
               "--max-restarts", "1", "--standalone", "--monitor-interval", "0.1", *common]
        if case.workload not in NO_CHECKPOINT:
            cmd += ["--ckpt_dir", str(workdir / "ckpt"), "--ckpt_every", str(case.ckpt_every)]
    return cmd, env, script


def hf_command(launcher: str, case: Case, workdir: Path) -> list[str]:
    """The Hugging Face Trainer example under ``launcher``: ``ftrun`` with its integration
    (``FTTrainer``), ``ftrun-restart`` and ``torchrun`` with the plain ``Trainer``, checkpointing every
    ``case.ckpt_every`` steps and resuming from the newest one after a whole-job restart."""
    common = [str(ROOT / "examples" / "hf_trainer.py"), "--max_steps", str(case.steps), "--step_times",
              "--output_dir", str(workdir / "out"), *case.args]
    plain = ["-m", "ftrun.integrations.hf_resume", *common, "--no_ftrun", "--save_steps", str(case.ckpt_every)]
    ftrun = [sys.executable, "-m", "ftrun", "--worker_num", str(case.ranks), "--master_port", "0", "--plain",
             "--tail_worker_log", "0", "--log_dir", str(workdir / "logs"), "--max_restarts", "1"]
    if launcher == "ftrun":
        return [*ftrun, *common]
    if launcher == "ftrun-restart":
        return [*ftrun, *plain]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case.ranks), "--max-restarts", "1",
            "--standalone", "--monitor-interval", "0.1", *plain]


def hot_ready(workdir: Path) -> bool:
    """Whether ftrun's hot spare waits at the training loop (its line in ``spares.log``)."""
    try:
        return "waits for a rank at the training loop" in (workdir / "logs" / "spares.log").read_text()
    except OSError:
        return False


def find_rank_pid(launcher_pid: int, rank: int, script: str) -> int | None:
    """PID of the process serving ``rank`` below the launcher (read from its environment; a promoted
    ftrun spare, ``python -m ftrun.rank.spare``, shows its rank's there too)."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            line = " ".join(child.cmdline())
            if (script in line or "ftrun.rank.spare" in line) and child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


class MemorySampler:
    """Polls the peak resident set (``VmHWM``) of a launcher's process tree, by role.

    Roles: ``launcher`` (the process started), ``supervisor`` (ftrun's), ``rank`` (the largest
    process running the training script; a rank forked by ftrun's fork server counts the pages it
    shares with it), ``fork_server`` and ``spare`` (ftrun's). VmHWM is the kernel's own high-water mark, so a peak
    between two polls is not missed; only processes that end between two polls are.
    """

    def __init__(self, root_pid: int, script: str, interval: float = 0.25) -> None:
        self.root_pid = root_pid
        self.script = script
        self.interval = interval
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _role(self, proc: psutil.Process) -> str | None:
        # Read the command line at every poll, never cached: a rank the supervisor respawns is,
        # between fork and exec, a copy of the supervisor under the same PID.
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            return None
        if proc.pid == self.root_pid:
            return "launcher"
        if "ftrun.node.supervisor" in cmdline:
            return "supervisor"
        if "ftrun.rank.spare" in cmdline:
            return "spare"  # a warm spare, idle or (same command line) promoted to a rank
        if "ftrun.rank.zygote" in cmdline:
            return "fork_server"  # its forked ranks show the script's command line (ftrun.rank.promotion.show_command)
        return "rank" if self.script in cmdline else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root_pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for proc in procs:
                role = self._role(proc)
                if role is None:
                    continue
                try:
                    with open(f"/proc/{proc.pid}/status") as status:
                        hwm = next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
                except (OSError, ValueError):
                    continue
                self.peaks[role] = max(self.peaks.get(role, 0.0), hwm / 1024)
            self._stop.wait(self.interval)


def ranks_cpu(launcher_pid: int, script: str) -> tuple[float, int]:
    """(CPU seconds used so far by the processes below the launcher that serve a rank, their count):
    every thread, user + system, of each process running ``script`` or a promoted ftrun spare with
    ``RANK`` in its environment."""
    total, count = 0.0, 0
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return total, count
    for child in children:
        try:
            line = " ".join(child.cmdline())
            if (script in line or "ftrun.rank.spare" in line) and "RANK" in child.environ():
                times = child.cpu_times()
                total, count = total + times.user + times.system, count + 1
        except psutil.Error:
            continue
    return total, count


def _kill_tree(pid: int) -> None:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def run_job(launcher: str, case: Case, timeout: float = 1200, steady_from: int | None = None) -> Run:
    """Run ``case`` under ``launcher`` in a fresh directory, kill ``case.victim`` when rank 0 prints
    ``case.kill_step``, and measure (a fault-free word_lm run: its steady state from ``steady_from``
    at the earliest, the step its ftrun pair's began at; see :func:`steady_start`).

    Raises:
        RuntimeError: the job failed, gave no final line, or the kill did not happen (the message
            holds the tail of its output).
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{launcher}-"))
    try:
        return _run_in(launcher, case, workdir, timeout, steady_from)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def warm_spare_ready(workdir: Path) -> float | None:
    """When ftrun's first warm spare had imported what it imports (its line in ``spares.log``, Unix
    time), or None (no warm spare, or not ready before the job ended)."""
    try:
        match = SPARE_READY.search((workdir / "logs" / "spares.log").read_text())
    except OSError:
        return None
    return float(match.group(1)) if match else None


def steady_start(lines: list[tuple[int, float]], per_epoch: int, spare_ready: float | None, launcher: str,
                 pair_from: int | None) -> int:
    """The first step of a fault-free run's steady state: after the first epoch (DDP's bucket
    rebuild, the first optimizer's imports) and, under ftrun, after the first step that began once
    the warm spare was ready. The spare's imports (about 2.5 s of CPU, at idle priority) are paid
    once a job; on 2 cores shared by 4 ranks they spill well past the first epoch. A torchrun run
    starts where its ftrun pair did (``pair_from``), so a pair compares the same steps. Under ftrun
    with no ready line (``--warm_spares 0``, or the job ended first) the steady state is the
    first epoch's end, or the last step when a spare was expected but never became ready."""
    start = per_epoch
    if launcher == "ftrun" and spare_ready is not None:
        start = max(start, next((s for s, t in lines if t >= spare_ready), lines[-1][0] if lines else start))
    if launcher != "ftrun" and pair_from is not None:
        start = max(start, pair_from)
    return start


def _run_in(launcher: str, case: Case, workdir: Path, timeout: float, steady_from: int | None = None) -> Run:
    cmd, env, script = command(launcher, case, workdir)
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[int, float]] = []
    cpu_lines: list[tuple[int, float]] = []  # (step, rank 0's training-thread CPU time, s) where printed
    tail: list[str] = []
    kill: dict[str, float] = {}
    cpu_marks: list[tuple[int, float, int]] = []  # fsdp, fault-free: (step, the ranks' CPU s so far, ranks seen)

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            del tail[:-400]
            match = STEP.search(line)
            if not match:
                continue
            step, stamp = int(match.group(1)), float(match.group(2))
            lines.append((step, stamp))
            if case.workload == "fsdp" and case.kill_step is None and step in (WARMUP_STEPS, case.steps - 1):
                cpu_marks.append((step, *ranks_cpu(proc.pid, script)))
            cpu = CPU.search(line)
            if cpu:
                cpu_lines.append((step, float(cpu.group(2))))
            if case.kill_step is not None and step >= case.kill_step and "time" not in kill and (
                    step == case.kill_step or (case.hot and not case.early)) and (
                    launcher != "ftrun" or not case.hot or case.early or hot_ready(workdir)):
                pid = find_rank_pid(proc.pid, case.victim, script)
                if pid is not None:
                    kill["time"] = time.time()
                    os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=reader, daemon=True)
    with MemorySampler(proc.pid, script) as memory:
        thread.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
        thread.join(timeout=10)
    total = time.time() - started
    text = "\n".join(tail)
    final = FINAL.search(text)
    # A plain Trainer's rank may abort at the interpreter's exit after training ended (gloo's threads
    # torn down: "terminate called without an active exception"); its result is in: kept, the code noted.
    exit_after_final = case.workload == "hf" and final is not None
    if (proc.returncode != 0 and not exit_after_final) or final is None or (case.kill_step is not None and "time" not in kill):
        raise RuntimeError(f"{launcher} {case.label()}: exit {proc.returncode}, final line {'found' if final else 'missing'}, "
                           f"kill {'done' if kill else 'not done'}:\n" + "\n".join(tail[-60:]))
    state = STATE_MB.search(text)
    run = Run(launcher, case, total_s=total, step_s=None, state_mb=float(state.group(1)) if state else None,
              final=final.group(0), peak_rss_mb={k: round(v, 1) for k, v in memory.peaks.items()},
              exit_codes=[proc.returncode], span_s=span(lines))
    if case.kill_step is None and case.workload == "wordlm" and case.steps > 1:
        # The steady state, after the job's one-time costs: the first epoch (DDP's bucket rebuild)
        # and ftrun's warm spare's imports (see steady_start); both reported apart.
        per_epoch = (max(s for s, _ in lines) + 1) // case.steps
        run.steady_from = steady_start(lines, per_epoch, warm_spare_ready(workdir), launcher, steady_from)
        run.step_s = steady_step_time(lines, warmup=run.steady_from)
        run.first_epoch_s = steady_step_time([x for x in lines if x[0] < per_epoch])
        run.spare_window_s = steady_step_time([x for x in lines if x[0] <= run.steady_from], warmup=per_epoch)
        run.cpu_s = steady_step_time(cpu_lines, warmup=run.steady_from)
        return run
    if case.kill_step is None:
        run.step_s = steady_step_time(lines)
        if len(cpu_marks) == 2 and cpu_marks[0][2] == cpu_marks[1][2] == case.ranks:
            (s0, c0, _), (s1, c1, _) = cpu_marks
            run.rank_cpu_s = (c1 - c0) / (s1 - s0) / case.ranks
        return run
    analyse_fault(run, lines, kill["time"], workdir / "logs" / "events.jsonl" if launcher == "ftrun" else None)
    return run


# ------------------------------------------------------------------------------- multi-node runs
def multinode_unavailable() -> str | None:
    """Why test hosts (network namespaces) cannot be made here, one line; None if they can."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from nethosts import unavailable_reason
    except Exception as exc:  # noqa: BLE001 - no test-host module: no multinode part
        return f"cannot import tests/nethosts.py: {exc}"
    return unavailable_reason()


def _base_env() -> dict[str, str]:
    """This process's environment without launcher, fault-injection or socket-interface settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT")) and k not in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def multinode_command(launcher: str, case: Case, node: int, hosts: list[Any], workdir: Path,
                      token: str, extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, script file name) of node ``node``'s launcher for ``case`` on ``hosts``.

    ``hosts`` are ``nethosts.NetHost`` objects (``.addr``, ``.env()``); node 0 hosts the store.
    ``extra``: launcher options placed after the defaults (a repeated option overrides them).
    """
    script = SCRIPTS[(case.workload, launcher)]
    local = case.ranks // case.nodes
    common = [str(ROOT / "examples" / script), "--steps", str(case.steps), "--log_every", "1", *case.args]
    if case.workload == "charlm":
        common += ["--size", case.size]
    env = _base_env()
    if launcher == "ftrun":
        # No GLOO_SOCKET_IFNAME: ftrun chooses the interface that routes to node 0 itself.
        env["FTRUN_TOKEN"] = token
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(case.ranks), "--local_worker_num", str(local),
               "--node_rank", str(node), "--master_addr", hosts[0].addr, "--master_port", str(FTRUN_PORT), "--plain",
               "--log_dir", str(workdir / f"logs{node}"), "--checkpoint_dir", str(workdir / "ckpt"),
               "--tail_worker_log", "0" if node == 0 else "", "--max_restarts", "1", *extra, *common]
    else:
        # What torchrun needed to restart at all across two hosts (see docs/benchmarks.md):
        # its own worker store (not the rendezvous one), the data-plane interface for gloo, this
        # host's address for the rendezvous and the worker store, and which node hosts the store.
        env = hosts[node].env(env)  # GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME = eth0
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(case.nodes), "--nproc-per-node", str(local),
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].addr}:{RDZV_PORT}",
               "--rdzv-id", "bench", "--rdzv-conf", f"is_host={1 if node == 0 else 0}", "--local-addr", hosts[node].addr,
               "--max-restarts", "1", "--monitor-interval", "0.1", *extra,
               *common, "--ckpt_dir", str(workdir / "ckpt"), "--ckpt_every", str(case.ckpt_every)]
    return cmd, env, script


def run_multinode_job(launcher: str, case: Case, timeout: float = 300) -> Run:
    """Run ``case`` under ``launcher`` on ``case.nodes`` fresh test hosts, one launcher per host;
    kill rank ``case.victim`` when rank 0 prints ``case.kill_step``, and measure as :func:`run_job`.

    Every run gets a new network (so nothing of a previous run is left in it) and a new directory;
    closing the network SIGKILLs whatever still runs in its namespaces.

    Raises:
        RuntimeError: a launcher failed or timed out, no final line, or the kill did not happen.
    """
    from nethosts import HostNetwork

    workdir = Path(tempfile.mkdtemp(prefix=f"bench-mn-{launcher}-"))
    net = None
    try:
        net = HostNetwork(case.nodes)
        return _run_multinode_in(launcher, case, net.hosts, workdir, timeout)
    except RuntimeError as err:
        # Keep a failed run's logs (ftrun: every node's LOG_DIR, worker logs and events).
        kept = Path(tempfile.mkdtemp(prefix=f"bench-mn-failed-{launcher}-"))
        shutil.copytree(workdir, kept, ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)
        raise RuntimeError(f"{err}\n(logs kept in {kept})") from None
    finally:
        if net is not None:
            net.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_multinode_in(launcher: str, case: Case, hosts: list[Any], workdir: Path, timeout: float) -> Run:
    token = secrets.token_hex(24)
    started = time.time()
    procs: list[subprocess.Popen[str]] = []
    script = SCRIPTS[(case.workload, launcher)]
    for node, host in enumerate(hosts):
        cmd, env, script = multinode_command(launcher, case, node, hosts, workdir, token)
        procs.append(host.popen(cmd, env=env, cwd=str(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True))
    lines: list[tuple[int, float]] = []
    tails: list[list[str]] = [[] for _ in procs]
    kill: dict[str, float] = {}
    lock = threading.Lock()

    def reader(node: int) -> None:
        out = procs[node].stdout
        assert out is not None
        for line in out:
            tails[node].append(line.rstrip())
            del tails[node][:-400]
            match = STEP.search(line)
            if not match:
                continue  # only rank 0 prints step lines, from whichever node it runs on
            step, stamp = int(match.group(1)), float(match.group(2))
            with lock:
                lines.append((step, stamp))
                if case.kill_step is None or step != case.kill_step or "time" in kill:
                    continue
                # The victim's launcher runs in a namespace, but pids are global: look below every
                # node's launcher, the last node first (where the victim is expected).
                for victim_node in reversed(range(len(procs))):
                    pid = find_rank_pid(procs[victim_node].pid, case.victim, script)
                    if pid is not None:
                        kill["time"] = time.time()
                        os.kill(pid, signal.SIGKILL)
                        kill["node"] = victim_node
                        break

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(len(procs))]
    for thread in threads:
        thread.start()
    deadline = started + timeout
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            _kill_tree(proc.pid)
        for proc in procs:
            proc.wait()
    for thread in threads:
        thread.join(timeout=10)
    total = time.time() - started
    codes = [proc.returncode for proc in procs]
    text = "\n".join(line for tail in tails for line in tail)
    final = FINAL.search(text)
    if timed_out or any(codes) or final is None or (case.kill_step is not None and "time" not in kill):
        raise RuntimeError(
            f"{launcher} {case.label()}: exit codes {codes}{' (timed out)' if timed_out else ''}, final line "
            f"{'found' if final else 'missing'}, kill {'done' if kill else 'not done'}:\n"
            + "\n".join(f"--- node {n} ---\n" + "\n".join(tail[-40:]) for n, tail in enumerate(tails)))
    lines.sort(key=lambda x: x[1])
    run = Run(launcher, case, total_s=total, step_s=None, final=final.group(0), exit_codes=codes)
    if case.kill_step is None:
        run.step_s = steady_step_time(lines)
        return run
    run.victim_node = int(kill["node"])
    analyse_fault(run, lines, kill["time"], workdir / "logs0" / "events.jsonl" if launcher == "ftrun" else None)
    return run


# ------------------------------------------------------------------------------- node loss
NODELOSS_FTRUN = ("--node_wait_timeout", "120", "--max_restarts", "4")
"""ftrun options of the nodeloss part (after multinode's: a repeated option overrides)."""


def run_nodeloss_job(launcher: str, case: Case, timeout: float = 420) -> Run:
    """Lose a whole node: ``case.nodes`` launchers on the first test hosts of ``case.nodes + 1``;
    when rank 0 prints ``case.kill_step``, SIGKILL every process in the last node's namespace and at
    once start a replacement launcher for that node (same command, same node index) on the spare
    host, as a pod restart would. Measured as :func:`run_job`. ``case.kill_step`` None: a
    fault-free run on the first ``case.nodes`` hosts (the reference digest).

    Raises:
        RuntimeError: a launcher other than the killed one failed or timed out, no final line, or
            the kill did not happen (the logs are kept; the path is in the message).
    """
    from nethosts import HostNetwork

    workdir = Path(tempfile.mkdtemp(prefix=f"bench-nl-{launcher}-"))
    net = None
    try:
        net = HostNetwork(case.nodes + 1)
        return _run_nodeloss_in(launcher, case, net.hosts, workdir, timeout)
    except RuntimeError as err:
        kept = Path(tempfile.mkdtemp(prefix=f"bench-nl-failed-{launcher}-"))
        shutil.copytree(workdir, kept, ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)
        raise RuntimeError(f"{err}\n(logs kept in {kept})") from None
    finally:
        if net is not None:
            net.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _run_nodeloss_in(launcher: str, case: Case, hosts: list[Any], workdir: Path, timeout: float) -> Run:
    token = secrets.token_hex(24)
    extra = NODELOSS_FTRUN if launcher == "ftrun" else ()
    if case.elastic and launcher == "ftrun":
        extra += ("--nnodes", f"{case.nodes - 1}:{case.nodes}", "--replace_timeout", "3")
    # the node lost and the host its replacement starts on; losing node 0 takes the coordinator and
    # the store with it (ftrun: node 1's standby coordinator takes over; torchrun cannot go on
    # without its rendezvous host, so the whole job is started again on the others, from its
    # checkpoint, at once: a scheduler's restart with no delay)
    lost = case.nodes - 1 if case.lost_node is None else case.lost_node
    spare = case.nodes
    survivors = [n for n in range(case.nodes) if n != lost]
    killed_procs: set[int] = set()  # indices in procs of launchers killed on purpose
    standby = launcher == "ftrun" and case.hot  # a standby launcher on the spare host before the loss
    standby_spares = workdir / f"logs{lost}-standby" / "spares.log"
    script = SCRIPTS[(case.workload, launcher)]
    procs: list[subprocess.Popen[str]] = []
    tails: list[list[str]] = []
    threads: list[threading.Thread] = []
    lines: list[tuple[int, float]] = []
    kill: dict[str, Any] = {}
    pids: dict[str, Any] = {}
    lock = threading.RLock()

    def rank_pids() -> dict[int, int | None]:
        found: dict[int, int | None] = {}
        for rank in range(case.ranks):
            found[rank] = next((pid for proc in procs if (pid := find_rank_pid(proc.pid, rank, script))), None)
        return found

    def standby_ready() -> bool:
        try:
            return standby_spares.read_text().count("waits for a rank at the training loop") >= case.ranks // case.nodes
        except OSError:
            return False

    def start(node: int, host_list: list[Any], log_suffix: str = "", on: Any = None) -> None:
        cmd, env, _ = multinode_command(launcher, case, node, host_list, workdir, token, extra)
        if case.elastic and launcher == "torchrun":  # MIN:MAX, and its re-rendezvous closes 1 s after MIN joined
            cmd[cmd.index("--nnodes") + 1] = f"{case.nodes - 1}:{case.nodes}"
            cmd[cmd.index("--rdzv-conf") + 1] += ",last_call_timeout=1"
        if launcher == "ftrun" and log_suffix:
            cmd[cmd.index("--log_dir") + 1] += log_suffix  # keep the lost node's logs apart
        if log_suffix == "-standby":
            at = cmd.index("--node_rank")
            del cmd[at:at + 2]  # the same command without a node index: a standby once every node has one
        proc = (on or host_list[node]).popen(cmd, env=env, cwd=str(workdir), stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        tails.append([])
        thread = threading.Thread(target=reader, args=(len(procs) - 1,), daemon=True)
        threads.append(thread)
        thread.start()

    def reader(index: int) -> None:
        out = procs[index].stdout
        assert out is not None
        for line in out:
            tails[index].append(line.rstrip())
            del tails[index][:-400]
            match = STEP.search(line)
            if not match:
                continue
            step, stamp = int(match.group(1)), float(match.group(2))
            with lock:
                lines.append((step, stamp))
                if case.kill_step is None:
                    continue
                if (step == case.kill_step or (standby and step > case.kill_step)) and "time" not in kill and (
                        not standby or standby_ready()):
                    pids["before"] = rank_pids()
                    kill["step"] = step
                    victims = hosts[lost].pids()
                    kill["time"] = time.time()
                    for pid in victims:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    kill["killed"] = len(victims)
                    killed_procs.add(lost)
                    if standby:  # started before the loss (negative: seconds before the kill)
                        kill["replacement_started"] = kill["standby_started"] - kill["time"]
                    elif case.elastic:
                        kill["replacement_started"] = float("nan")  # none: the job goes on with the nodes left
                    elif lost == 0 and launcher == "torchrun":
                        # The whole job again, on the surviving hosts and the spare (its node 0).
                        for index in survivors:
                            killed_procs.add(index)
                            for pid in hosts[index].pids():
                                try:
                                    os.kill(pid, signal.SIGKILL)
                                except ProcessLookupError:
                                    pass
                        again = [hosts[spare], *(hosts[n] for n in survivors)]
                        for node in range(case.nodes):
                            start(node, again, "-replacement")
                        kill["replacement_started"] = time.time() - kill["time"]
                    else:
                        # The replacement: same command and node index, the spare host's address.
                        start(lost, [*hosts[:lost], hosts[spare]], "-replacement")
                        kill["replacement_started"] = time.time() - kill["time"]
                elif "time" in kill and "after" not in pids and step >= kill["step"] + 20:
                    pids["after"] = rank_pids()

    def every_node_joined() -> bool:
        try:
            text = (workdir / "logs0" / "events.jsonl").read_text()
        except OSError:
            return False
        return text.count('"kind": "node_joined"') >= case.nodes - 1

    started = time.time()
    with lock:
        for node in range(case.nodes):
            start(node, hosts)
    deadline = started + timeout
    timed_out = True
    while time.time() < deadline:
        with lock:
            if standby and "standby_started" not in kill and every_node_joined():
                # every node has its index: a standby (same command, on the spare host)
                start(lost, hosts[:case.nodes], "-standby", on=hosts[spare])
                kill["standby_started"] = time.time()
            current = list(procs)
        if all(proc.poll() is not None for proc in current):
            timed_out = False
            break
        time.sleep(0.2)
    with lock:
        current = list(procs)
    if timed_out:
        for proc in current:
            _kill_tree(proc.pid)
    for proc in current:
        proc.wait()
    for thread in threads:
        thread.join(timeout=10)
    total = time.time() - started
    codes = [proc.returncode for proc in current]
    text = "\n".join(line for tail in tails for line in tail)
    final = FINAL.search(text)
    # The killed launcher's own exit code does not count (index ``lost``, SIGKILLed).
    bad = [c for i, c in enumerate(codes) if c and not (i in killed_procs and "time" in kill)]
    if timed_out or bad or final is None or (case.kill_step is not None and "time" not in kill):
        names = [f"node {n}" for n in range(case.nodes)] + [f"node {lost} {'standby' if standby else 'replacement'} (host {spare})"]
        raise RuntimeError(
            f"{launcher} nodeloss {case.label()}: exit codes {codes}{' (timed out)' if timed_out else ''}, final line "
            f"{'found' if final else 'missing'}, kill {'done' if kill else 'not done'}:\n"
            + "\n".join(f"--- {names[n]} ---\n" + "\n".join(tail[-40:]) for n, tail in enumerate(tails)))
    lines.sort(key=lambda x: x[1])
    run = Run(launcher, case, total_s=total, step_s=None, final=final.group(0), exit_codes=codes,
              pids={k: {str(r): p for r, p in v.items()} for k, v in pids.items()})
    if case.kill_step is None:
        run.step_s = steady_step_time(lines)
        return run
    run.victim_node = lost
    analyse_fault(run, lines, kill["time"], None)
    # What the surviving launcher said about the fault (torchrun's agent logs, ftrun's events).
    run.pids["node0_log"] = [line for line in tails[0] if not STEP.search(line)
                             and re.search(r"elastic|rendezvous|restart|node_lost|node_joined|recover", line, re.I)][-40:]
    run.breakdown["killed_processes"] = kill["killed"]
    run.breakdown["replacement_started"] = round(kill["replacement_started"], 4)
    if launcher == "ftrun":
        passed = kill["time"] + (run.recover_s or 0.0)
        coordinator = workdir / f"logs{0 if lost else 1}" / "events.jsonl"  # node 1's after a takeover
        breakdown = elastic_breakdown if case.elastic else nodeloss_breakdown
        run.breakdown.update(breakdown(coordinator, kill["time"], passed))
    return run


def elastic_breakdown(events_path: Path, kill_time: float, passed: float) -> dict[str, float]:
    """Split ftrun's recovery of an elastic job from a lost node with no replacement (kill -> failed
    step done again) from node 0's events.jsonl: detection (kill -> node_lost), wait (-> job_shrunk:
    --replace_timeout), recovery (-> recovery_finished: the node's ranks started on the other nodes,
    their set-up, the group rebuild, the transfers) and retried (-> the failed step done)."""
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    lost = next(e for e in events if e["kind"] == "node_lost" and e["time"] > kill_time)
    shrunk = next(e for e in events if e["kind"] == "job_shrunk" and e["time"] > lost["time"])
    finished = next(e for e in events if e["kind"] == "recovery_finished" and e["time"] > shrunk["time"])
    parts = {"detection": lost["time"] - kill_time, "wait": shrunk["time"] - lost["time"],
             "recovery": finished["time"] - shrunk["time"], "retried": passed - finished["time"]}
    return {k: round(v, 4) for k, v in parts.items()}


def nodeloss_breakdown(events_path: Path, kill_time: float, passed: float) -> dict[str, float]:
    """Split ftrun's recovery from a lost node (kill -> failed step done again) from node 0's
    events.jsonl: detection (kill -> node_lost), join (node_lost -> the replacement's node_joined),
    recovery (node_joined -> recovery_finished: respawn of the node's ranks, their set-up, the group
    rebuild and the state transfer) and retried (-> the failed step done); with recovery_finished's
    own figures (transfer, rebuild, bytes) and the total it reports."""
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    lost = next(e for e in events if e["kind"] == "node_lost" and e["time"] > kill_time)
    joined = next(e for e in events if e["kind"] == "node_joined" and e["time"] > lost["time"])
    finished = next(e for e in events if e["kind"] == "recovery_finished" and e["time"] > lost["time"])
    detail = finished["detail"]
    parts = {
        "detection": lost["time"] - kill_time,
        "join": joined["time"] - lost["time"],
        "recovery": finished["time"] - joined["time"],
        "retried": passed - finished["time"],
        "transfer": float(detail.get("transfer_seconds") or 0.0),
        "rebuild": float(detail.get("rebuild_seconds") or 0.0),
        "respawn": max((float(v) for v in (detail.get("respawn_seconds") or {}).values()), default=0.0),
        "bytes": float(detail.get("bytes") or 0),
        "reported_total": float(detail.get("total_seconds") or 0.0),
        "failed_ranks": len(detail.get("failed") or []),
    }
    return {k: round(v, 4) for k, v in parts.items()}


def span(lines: list[tuple[int, float]]) -> float | None:
    """Seconds from the first step line to the last (rank 0's clock; a restart's lines included)."""
    stamps = [t for _, t in lines]
    return max(stamps) - min(stamps) if stamps else None


def steady_step_time(lines: list[tuple[int, float]], skip: tuple[float, float] | None = None,
                     warmup: int = WARMUP_STEPS) -> float | None:
    """Median interval between consecutive steps' lines from step ``warmup`` on, leaving out
    intervals that overlap ``skip`` (a (start, end) window around a fault)."""
    gaps = []
    for (s0, t0), (s1, t1) in zip(lines, lines[1:]):
        if s1 != s0 + 1 or s0 < warmup:
            continue
        if skip is not None and t1 > skip[0] and t0 < skip[1]:
            continue
        gaps.append(t1 - t0)
    return statistics.median(gaps) if gaps else None


def analyse_fault(run: Run, lines: list[tuple[int, float]], kill_time: float, events_path: Path | None) -> None:
    """Fill ``run``'s fault fields from rank 0's step lines (its own clock) and ftrun's events.

    The step lines reach us late (through a log and the launcher), so everything is decided from
    their timestamps. The victim may die after its part of the step in progress, which then still
    finishes: the fault shows as the longest pause between step lines after the kill, and the failed
    step is the first one not finished before that pause.
    """
    seq = [(max((s for s, t in lines if t <= kill_time), default=-1), kill_time)]
    seq += [(s, t) for s, t in lines if t > kill_time]
    gap = max(range(len(seq) - 1), key=lambda i: seq[i + 1][1] - seq[i][1])
    failed = seq[gap][0] + 1
    resumed_step, resumed_at = seq[gap + 1]
    passed = next(t for s, t in seq[gap + 1:] if s >= failed)
    run.failed_step = failed
    run.recover_s = passed - kill_time
    run.recomputed = max(0, failed - resumed_step)
    run.step_s = steady_step_time(lines, skip=(kill_time, passed))
    if events_path is None:
        run.breakdown = {"restart": resumed_at - kill_time, "recompute": passed - resumed_at}
        return
    run.breakdown = ftrun_breakdown(events_path, run.case.victim, kill_time, passed)


def ftrun_breakdown(events_path: Path, victim: int, kill_time: float, passed: float) -> dict[str, float]:
    """Split ftrun's recovery (kill -> failed step done again) into parts that sum to the whole.

    From events.jsonl: rank_failed (detection), the victim's next rank_joined (its hello: process
    start and imports), each rank_recovered's ``rebuild_seconds`` (the survivors' includes waiting
    for the new rank's own set-up; the new rank's is the group build alone), recovery_finished's
    ``transfer_seconds``, and the retried step from the step clock.
    """
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    failed = next(e for e in events if e["kind"] == "rank_failed" and e["rank"] == victim)
    joined = next(e for e in events if e["kind"] == "rank_joined" and e["rank"] == victim and e["time"] > failed["time"])
    recovered = [e for e in events if e["kind"] == "rank_recovered" and e["time"] > failed["time"]]
    finished = next(e for e in events if e["kind"] == "recovery_finished" and e["time"] > failed["time"])
    detected_at = failed["detail"].get("detected_at") or failed["time"]
    rebuilds = {e["rank"]: float(e["detail"].get("rebuild_seconds") or 0.0) for e in recovered}
    recipient = max((v for r, v in rebuilds.items() if r == victim), default=0.0)
    setup = max(rebuilds.values(), default=0.0) - recipient
    transfer = float(finished["detail"].get("transfer_seconds") or 0.0)
    parts = {
        "detection": detected_at - kill_time,
        "respawn": joined["time"] - detected_at,
        "setup": setup,
        "rebuild": recipient,
        "transfer": transfer,
        "retried": passed - finished["time"],
    }
    parts["other"] = (passed - kill_time) - sum(parts.values())
    parts["bytes"] = float(finished["detail"].get("bytes") or 0)
    parts["reported_total"] = float(finished["detail"].get("total_seconds") or 0.0)
    return {k: round(v, 4) for k, v in parts.items()}


# ------------------------------------------------------------------------------------------ plans
def plan(args: argparse.Namespace) -> dict[str, list[Case]]:
    """The cases of each part asked for (``--quick`` shrinks every one of them)."""
    q = args.quick
    parts: dict[str, list[Case]] = {}
    if "recovery" in args.parts:
        parts["recovery"] = [
            Case("digits", "-", 4, 60 if q else 120, 30 if q else 60, victim=2, ckpt_every=25),
            Case("charlm", "small", 4, 30 if q else 60, 15 if q else 30, victim=2, ckpt_every=25 if not q else 10,
                 args=CHARLM_SMALL),
            # Hot spares: long enough that the spare is past the script's set-up; ftrun's kill comes
            # at the first step from kill_step on at which it is (torchrun's at kill_step).
            Case("digits", "-", 4, 800, 200, victim=2, ckpt_every=25, hot=True),
            Case("charlm", "small", 4, 200, 40, victim=2, ckpt_every=25, args=CHARLM_SMALL, hot=True),
            # ... and killed at step 170 (about 5 s after the ranks start), the hot spare still in
            # its set-up: it takes the rank all the same (docs/hot_spares.md).
            Case("digits", "-", 4, 800, 170, victim=2, ckpt_every=25, hot=True, early=True),
        ]
    if "scaling-world" in args.parts:
        worlds = [2, 4] if q else [int(w) for w in args.worlds.split(",")]
        # --hot: with a hot spare, long enough for it to be ready (the kill waits for it).
        parts["scaling-world"] = [Case("charlm", "tiny", w, 300 if getattr(args, "hot", False) else 30, 15, victim=1, ckpt_every=10,
                                       args=CHARLM_SMALL, hot=getattr(args, "hot", False)) for w in worlds]
    if "scaling-state" in args.parts:
        sizes = ["tiny", "small"] if q else args.sizes.split(",")
        # Short jobs for the slow sizes; fast ones need more steps after the kill, or they finish
        # before the kill (delivered on seeing rank 0's line through the log) lands.
        parts["scaling-state"] = [Case("charlm", s, 2, *((10, 5) if s in ("medium", "large", "xl") else (30, 15)),
                                       victim=1, ckpt_every=4, args=CHARLM_SMALL) for s in sizes]
    if "overhead" in args.parts:
        parts["overhead"] = [
            Case("digits", "-", 4, 60 if q else 150, None),
            Case("charlm", "small", 2, 30 if q else 80, None, args=CHARLM_SMALL),
        ]
    if "hf" in args.parts:  # killed mid-run; the plain Trainer checkpoints every 8 steps (resumes from step 16)
        parts["hf"] = [Case("hf", "tiny", 4, 24 if q else 40, 12 if q else 20, ckpt_every=5 if q else 8)]
    if "overhead-real" in args.parts:
        # pytorch/examples' word language model as ported: its own small steps, and larger.
        lines = ("--train-lines", "600" if q else "3000")
        # Epochs: about 750 small steps and 260 large ones (a large epoch is 22 steps): the warm
        # spare's imports end about 3 s into training here (small step 220, large step 80), and the
        # steady state starts there (steady_start), with several seconds of it left.
        parts["overhead-real"] = [Case("wordlm", "small", 4, 2 if q else 6, None, args=lines),
                                  Case("wordlm", "large", 4, 2 if q else 12, None, args=lines)]
    if "memory" in args.parts:
        worlds = [2, 4] if q else [int(w) for w in args.worlds.split(",")]
        parts["memory"] = [Case("charlm", "tiny", w, 30, 15, victim=1, ckpt_every=10, args=CHARLM_SMALL) for w in worlds]
    if "multinode" in args.parts:
        # 2 hosts x 2 ranks; rank 3 runs on host 1. Kill at 60 with checkpoints every 25, as in the
        # single-node digits case, so torchrun's recompute is comparable.
        parts["multinode"] = [Case("digits", "-", 4, 100 if q else 200, 40 if q else 60, victim=3, ckpt_every=25,
                                   nodes=2)]
    if "nodeloss" in args.parts:
        # 2 hosts x 2 ranks and a spare host; all of host 1 (ranks 2 and 3, its launcher) is killed.
        # --standby: ftrun's spare host runs a standby node from the start; longer, so its spares are ready.
        standby = getattr(args, "standby", False)
        parts["nodeloss"] = [Case("digits", "-", 4, 1200 if standby else 100 if q else 200,
                                  300 if standby else 40 if q else 60, victim=3, ckpt_every=25, nodes=2, hot=standby,
                                  lost_node=lost) for lost in getattr(args, "lost_nodes", [None])]
    if "elastic" in args.parts:
        # 3 hosts x 2 ranks, --nnodes 2:3; all of host 2 (ranks 4 and 5, its launcher) is killed, no replacement.
        parts["elastic"] = [Case("digits", "-", 6, 100 if q else 200, 40 if q else 60, victim=5, ckpt_every=25, nodes=3,
                                 elastic=True)]
    if "fsdp" in args.parts:
        # HSDP 2x2, 4 ranks: a fault-free pair and a pair with rank 3 (rank 1's replica) killed
        # halfway; torchrun's twin has no checkpoint and starts again at step 0.
        steps = getattr(args, "fsdp_steps", None) or (60 if q else FSDP_STEPS)
        parts["fsdp"] = [Case("fsdp", "hsdp", 4, steps, None, args=FSDP_ARGS),
                         Case("fsdp", "hsdp", 4, steps, steps // 2, victim=3, args=FSDP_ARGS)]
    only = getattr(args, "only", None)
    if only:  # --only: the cases whose label has that text
        parts = {name: [c for c in cases if only in c.label()] for name, cases in parts.items()}
    return parts


def launcher_order(part: str, repeat: int) -> tuple[str, ...]:
    """The launchers of ``part`` in the order repeat ``repeat`` runs them (reversed every other
    repeat for the parts in :data:`ALTERNATING`, so neither always runs first)."""
    launchers = PART_LAUNCHERS.get(part, LAUNCHERS)
    return tuple(reversed(launchers)) if part in ALTERNATING and repeat % 2 else launchers


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Run every case of every part ``args.repeats`` times, both launchers back to back."""
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["python scripts/bench.py", *sys.argv[1:]]),
                               "parts": {}}
    if "transfer" in args.parts:
        print("[transfer] raw send_state/recv_state between two processes ...", file=sys.stderr, flush=True)
        sizes = [1, 10, 100] if args.quick else [1, 10, 100, 400, 1000]
        results["transfer"] = run_transfer(sizes, 1 if args.quick else 3)
    for part, cases in plan(args).items():
        job = run_job
        if part in ("multinode", "nodeloss", "elastic"):
            reason = multinode_unavailable()
            if reason is not None:
                print(f"[{part}] skipped: {reason}", file=sys.stderr, flush=True)
                results.setdefault("skipped", {})[part] = reason
                continue
            job = run_multinode_job if part == "multinode" else run_nodeloss_job  # elastic: a nodeloss case
            results[f"{part}_reference"] = multinode_references(cases, results, part, job)
        runs: list[dict[str, Any]] = []
        results["parts"][part] = runs
        if part in DEFAULT_REPEATS:
            repeats = args.repeats if args.repeats is not None else DEFAULT_REPEATS[part]
        else:
            repeats = args.scaling_repeats
        for repeat in range(repeats):
            for case in cases:
                pair_from = None  # overhead-real: where the ftrun run's steady state began (see steady_start)
                for launcher in launcher_order(part, repeat):
                    print(f"[{part}] {case.label()} {launcher} repeat {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
                    try:
                        run = job(launcher, case, steady_from=pair_from) if part == "overhead-real" else job(launcher, case)
                        pair_from = run.steady_from if launcher == "ftrun" else pair_from
                    except RuntimeError as err:  # keep the rest of the benchmark; the error is in the JSON
                        print(f"    FAILED: {err}", file=sys.stderr, flush=True)
                        results.setdefault("errors", []).append(str(err)[-3000:])
                        continue
                    runs.append(asdict(run) | {"repeat": repeat})
                    print(f"    total {run.total_s:.1f} s, recover {_fmt(run.recover_s)} s, step {_fmt(run.step_s, 4)} s",
                          file=sys.stderr, flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def multinode_references(cases: list[Case], results: dict[str, Any], part: str = "multinode",
                         job: Any = None) -> list[dict[str, Any]]:
    """One fault-free run of each multinode (or nodeloss) case under each launcher: the reference digests."""
    job = job or run_multinode_job
    refs = []
    seen: set[str] = set()
    for case in cases:
        clean = Case(case.workload, case.size, case.ranks, case.steps, None, ckpt_every=case.ckpt_every,
                     args=case.args, nodes=case.nodes)
        if clean.label() in seen:
            continue  # the same job with another host killed: one reference
        seen.add(clean.label())
        for launcher in LAUNCHERS:
            print(f"[{part}] {clean.label()} {launcher} fault-free reference ...", file=sys.stderr, flush=True)
            try:
                run = job(launcher, clean)
            except RuntimeError as err:
                print(f"    FAILED: {err}", file=sys.stderr, flush=True)
                results.setdefault("errors", []).append(str(err)[-3000:])
                continue
            refs.append(asdict(run))
            print(f"    total {run.total_s:.1f} s, step {_fmt(run.step_s, 4)} s", file=sys.stderr, flush=True)
    return refs


def machine() -> dict[str, Any]:
    """A short description of this machine: CPU, cores, memory, OS, Python and torch versions."""
    import torch

    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "ftrun_commit": _git("rev-parse", "--short", "HEAD").strip() or "?",
        # ftrun's files changed since that commit (the tree is edited while benchmarks run)
        "ftrun_uncommitted": _git("status", "--porcelain", "--", "ftrun").splitlines(),
    }


def _git(*args: str) -> str:
    """What ``git ARGS`` prints in this tree; empty where there is no git or no repository (a copy of
    the tree on a lent machine)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ report
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) - min(values) if values else None


def _groups(runs: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]]:
    """(workload, size, ranks, nodes, hot, lost node) -> launcher -> runs, in first-seen order; pairs share a repeat index."""
    out: dict[Any, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        c = r["case"]
        key = (c["workload"], c["size"], c["ranks"], c.get("nodes", 1), c.get("hot", False), c.get("lost_node"),
               c.get("early", False))
        out.setdefault(key, {l: [] for l in LAUNCHERS}).setdefault(r["launcher"], []).append(r)
    return out


def _label(key: tuple[Any, ...]) -> str:
    """``digits x4`` on one node, ``digits 2x2`` (nodes x ranks per node) on several; ``hot``: ftrun
    ran with a hot spare (``early``: killed before it was ready)."""
    workload, size, ranks, nodes, hot, *rest = key
    lost, early = (rest + [None, False])[:2]
    name = workload if workload == "digits" else f"{workload}-{size}"
    return ((f"{name} x{ranks}" if nodes <= 1 else f"{name} {nodes}x{ranks // nodes}") + (" hot" if hot else "")
            + (" early" if early else "") + (f" host{lost}" if lost is not None else ""))


def _pair_ratio(group: dict[str, list[dict[str, Any]]], metric: str, num: str, den: str) -> float | None:
    by_repeat = {l: {r["repeat"]: r[metric] for r in rows} for l, rows in group.items()}
    if num not in by_repeat or den not in by_repeat:
        return None
    ratios = [by_repeat[num][k] / by_repeat[den][k] for k in by_repeat[num]
              if k in by_repeat[den] and by_repeat[num][k] and by_repeat[den][k]]
    return statistics.median(ratios) if ratios else None


def fault_table(runs: list[dict[str, Any]]) -> list[str]:
    """Recovery table: one row per case and launcher, with each other launcher's pairwise ratio to
    ftrun (x/ft: its recovery time over ftrun's)."""
    out = [f"{'case':<18} {'launcher':<13} {'state_MB':>8} {'failed':>6} {'recover_s':>9} {'spread':>7} "
           f"{'recomp':>6} {'total_s':>7} {'step_ms':>7} {'x/ft':>6}"]
    for key, group in _groups(runs).items():
        for launcher, rows in group.items():
            if not rows:
                continue
            ratio = _pair_ratio(group, "recover_s", launcher, "ftrun") if launcher != "ftrun" else None
            step = _med([r["step_s"] for r in rows])
            out.append(
                f"{_label(key):<18} {launcher:<13} {_fmt(_med([r['state_mb'] for r in rows]), 1):>8} "
                f"{_fmt(_med([r['failed_step'] for r in rows]), 0):>6} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                f"{_fmt(_spread([r['recover_s'] for r in rows])):>7} {_fmt(_med([r['recomputed'] for r in rows]), 0):>6} "
                f"{_fmt(_med([r['total_s'] for r in rows]), 1):>7} {_fmt(step * 1e3 if step else None, 1):>7} "
                f"{(_fmt(ratio) + 'x') if ratio else '':>6}"
            )
    return out


def digest_notes(runs: list[dict[str, Any]]) -> list[str]:
    """Which final parameter digests each launcher's faulted runs ended with (equal digests across
    launchers: the same parameters, bitwise)."""
    digests: dict[str, set[str]] = {}
    for r in runs:
        match = FINAL.search(r.get("final") or "")
        digests.setdefault(r["launcher"], set()).add(match.group(3)[:16] if match else "?")
    everyone = set().union(*digests.values()) if digests else set()
    notes = [f"final params digests: " + "; ".join(f"{l} {', '.join(sorted(d))}" for l, d in digests.items())
             + (" (all equal)" if len(everyone) == 1 else " (they differ)")]
    failed_exits = [(r["launcher"], r["repeat"], r["exit_codes"][0]) for r in runs if r.get("exit_codes") and r["exit_codes"][0]]
    if failed_exits:
        notes.append("exit codes other than 0 after the final line (a rank that aborted at its exit): "
                     + ", ".join(f"{l} repeat {k + 1}: {c}" for l, k, c in failed_exits))
    return notes


BREAKDOWN = ("detection", "respawn", "setup", "rebuild", "transfer", "retried", "other")


def breakdown_table(runs: list[dict[str, Any]]) -> list[str]:
    """Where ftrun's recovery time goes (medians, seconds), and torchrun's restart/recompute split."""
    out = [f"{'case':<18} {'recover_s':>9} " + " ".join(f"{p:>9}" for p in BREAKDOWN) + f" {'MB':>8} {'GB/s':>6}"]
    tr = [f"{'case':<18} {'recover_s':>9} {'restart':>9} {'recompute':>9}"]
    for key, group in _groups(runs).items():
        rows = group["ftrun"]
        if rows:
            parts = {p: _med([r["breakdown"].get(p) for r in rows]) for p in BREAKDOWN}
            nbytes = _med([r["breakdown"].get("bytes") for r in rows]) or 0.0
            rate = _med([r["breakdown"]["bytes"] / r["breakdown"]["transfer"] / 1e9 for r in rows
                         if r["breakdown"].get("transfer")])
            out.append(f"{_label(key):<18} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                       + " ".join(f"{_fmt(parts[p], 3):>9}" for p in BREAKDOWN)
                       + f" {nbytes / 1e6:>8.1f} {_fmt(rate):>6}")
        rows = group["torchrun"]
        if rows:
            tr.append(f"{_label(key):<18} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                      f"{_fmt(_med([r['breakdown'].get('restart') for r in rows])):>9} "
                      f"{_fmt(_med([r['breakdown'].get('recompute') for r in rows])):>9}")
    return out + ["", "torchrun:"] + tr


NODELOSS_PARTS = ("detection", "join", "recovery", "retried", "respawn", "rebuild", "transfer")


def nodeloss_table(runs: list[dict[str, Any]]) -> list[str]:
    """ftrun's node-loss recovery split (see :func:`nodeloss_breakdown`) and torchrun's restart/recompute."""
    out = [f"{'case':<18} {'recover_s':>9} " + " ".join(f"{p:>9}" for p in NODELOSS_PARTS) + f" {'MB':>6}"]
    tr = [f"{'case':<18} {'recover_s':>9} {'restart':>9} {'recompute':>9}"]
    for key, group in _groups(runs).items():
        rows = group["ftrun"]
        if rows:
            nbytes = _med([r["breakdown"].get("bytes") for r in rows]) or 0.0
            out.append(f"{_label(key):<18} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                       + " ".join(f"{_fmt(_med([r['breakdown'].get(p) for r in rows]), 3):>9}" for p in NODELOSS_PARTS)
                       + f" {nbytes / 1e6:>6.1f}")
        rows = group["torchrun"]
        if rows:
            tr.append(f"{_label(key):<18} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                      f"{_fmt(_med([r['breakdown'].get('restart') for r in rows])):>9} "
                      f"{_fmt(_med([r['breakdown'].get('recompute') for r in rows])):>9}")
    return out + ["", "torchrun:"] + tr


ELASTIC_PARTS = ("detection", "wait", "recovery", "retried")


def elastic_table(runs: list[dict[str, Any]]) -> list[str]:
    """ftrun's split of an elastic job's loss (see :func:`elastic_breakdown`) and torchrun's restart/recompute."""
    out = [f"{'case':<24} {'recover_s':>9} " + " ".join(f"{p:>9}" for p in ELASTIC_PARTS)]
    tr = [f"{'case':<24} {'recover_s':>9} {'restart':>9} {'recompute':>9}"]
    for key, group in _groups(runs).items():
        for launcher, table, names in (("ftrun", out, ELASTIC_PARTS), ("torchrun", tr, ("restart", "recompute"))):
            rows = group[launcher]
            if rows:
                table.append(f"{_label(key) + ' elastic':<24} {_fmt(_med([r['recover_s'] for r in rows])):>9} "
                             + " ".join(f"{_fmt(_med([r['breakdown'].get(p) for r in rows]), 3):>9}" for p in names))
    return out + ["", "torchrun:"] + tr


def nodeloss_pid_notes(runs: list[dict[str, Any]]) -> list[str]:
    """Per run: which ranks kept their pid through the node loss (pids before the kill and 20 steps after)."""
    out = []
    for r in runs:
        before, after = r.get("pids", {}).get("before", {}), r.get("pids", {}).get("after", {})
        kept = [k for k in sorted(before) if before[k] and before[k] == after.get(k)]
        new = [k for k in sorted(after) if after[k] and after[k] != before.get(k)]
        out.append(f"{r['launcher']} repeat {r['repeat'] + 1}: ranks with the same pid after recovery {kept or '-'}, "
                   f"new pid {new or '-'}; {r['breakdown'].get('killed_processes', '?'):.0f} processes killed on host {r.get('victim_node', 1)}; "
                   f"exit codes {r.get('exit_codes')}")
    return out


def overhead_table(runs: list[dict[str, Any]]) -> list[str]:
    """Fault-free step time of ftrun against plain torchrun DDP, ratio pair by pair."""
    out = [f"{'case':<18} {'ftrun_ms':>8} {'torchrun_ms':>11} {'spread_ft':>9} {'spread_tr':>9} {'overhead':>8}"
           f" {'first_epoch':>11} {'from':>5} {'spare_window':>12} {'cpu_ft_ms':>9} {'cpu_tr_ms':>9} {'cpu_extra':>9}"]
    for key, group in _groups(runs).items():
        ft, tr = [r["step_s"] for r in group["ftrun"]], [r["step_s"] for r in group["torchrun"]]
        ratio = _pair_ratio(group, "step_s", "ftrun", "torchrun")
        first = _pair_ratio(group, "first_epoch_s", "ftrun", "torchrun") if all(
            r.get("first_epoch_s") for rows in group.values() for r in rows) else None
        window = _pair_ratio(group, "spare_window_s", "ftrun", "torchrun") if all(
            r.get("spare_window_s") for rows in group.values() for r in rows) else None
        start = _med([r["steady_from"] for r in group["ftrun"] if r.get("steady_from") is not None])
        cpu = all(r.get("cpu_s") for rows in group.values() for r in rows)
        cpu_ft, cpu_tr = (_med([r["cpu_s"] for r in group[k]]) if cpu else None for k in ("ftrun", "torchrun"))
        cpu_ratio = _pair_ratio(group, "cpu_s", "ftrun", "torchrun") if cpu else None
        out.append(f"{_label(key):<18} {_fmt((_med(ft) or 0) * 1e3, 2):>8} {_fmt((_med(tr) or 0) * 1e3, 2):>11} "
                   f"{_fmt((_spread(ft) or 0) * 1e3, 2):>9} {_fmt((_spread(tr) or 0) * 1e3, 2):>9} "
                   f"{_fmt((ratio - 1) * 100 if ratio else None, 1) + '%':>8}"
                   f" {(_fmt((first - 1) * 100, 1) + '%') if first else '-':>11}"
                   f" {_fmt(start, 0) if start is not None else '-':>5}"
                   f" {(_fmt((window - 1) * 100, 1) + '%') if window else '-':>12}"
                   f" {_fmt(cpu_ft * 1e3, 2) if cpu_ft else '-':>9} {_fmt(cpu_tr * 1e3, 2) if cpu_tr else '-':>9}"
                   f" {(_fmt((cpu_ratio - 1) * 100, 1) + '%') if cpu_ratio else '-':>9}")
    return out


def _by_repeat(runs: list[dict[str, Any]], launcher: str, faulted: bool) -> dict[int, dict[str, Any]]:
    return {r["repeat"]: r for r in runs if r["launcher"] == launcher and (r["case"]["kill_step"] is not None) == faulted}


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den where both are positive, else None (a negative loss, within the noise, has no ratio)."""
    return num / den if num and den and num > 0 and den > 0 else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def wall_time_lost(faulted: dict[str, Any] | None, clean: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """Seconds a faulted run lost against a fault-free run of the same job: its span (first step
    line to last) less the fault-free span, and less the fault-free span scaled by the two runs'
    median steps away from the fault (the load of a shared machine changes from one run to the
    next: the pace-adjusted figure compares them at the faulted run's own pace). None where a run
    or a figure is missing."""
    if not faulted or not clean or not faulted.get("span_s") or not clean.get("span_s"):
        return None, None
    raw = faulted["span_s"] - clean["span_s"]
    if not faulted.get("step_s") or not clean.get("step_s"):
        return raw, None
    return raw, faulted["span_s"] - clean["span_s"] * faulted["step_s"] / clean["step_s"]


FSDP_RATIOS = ("recovery", "restart", "lost", "lost_paced", "step", "step_faulted", "cpu")


def fsdp_notes(runs: list[dict[str, Any]]) -> list[str]:
    """The fsdp part pair by pair: each launcher's recovery (ftrun's with its ``recovery_finished``
    figures, torchrun's split into restart and recompute), the wall time each lost against its own
    fault-free run of the same repeat (see :func:`wall_time_lost`), the ratios torchrun/ftrun, the
    step times' ratio ftrun/torchrun (the fault-free pair's, and the faulted pair's away from the
    fault), and whether every final ``params_sha256`` equals the fault-free runs'; then the
    medians of the ratios."""
    ft, tr = _by_repeat(runs, "ftrun", True), _by_repeat(runs, "torchrun", True)
    ft0, tr0 = _by_repeat(runs, "ftrun", False), _by_repeat(runs, "torchrun", False)
    reference = sorted({d for r in runs if r["case"]["kill_step"] is None and (d := _digest(r["final"]))})
    out: list[str] = []
    ratios: dict[str, list[float]] = {name: [] for name in FSDP_RATIOS}
    for k in sorted(set(ft) | set(tr) | set(ft0) | set(tr0)):
        order = " then ".join(launcher_order("fsdp", k % 1000))
        # runs pooled by --from_json: the n-th file's repeats are numbered from (n - 1) * 1000 (merge)
        out.append(f"repeat {k % 1000 + 1}{f' of file {k // 1000 + 1}' if k >= 1000 else ''} ({order}):")
        lost: dict[str, tuple[float | None, float | None]] = {}
        for launcher, faulted, clean in (("ftrun", ft, ft0), ("torchrun", tr, tr0)):
            r = faulted.get(k)
            lost[launcher] = wall_time_lost(r, clean.get(k))
            if r is None:
                out.append(f"  {launcher}: no faulted run")
                continue
            b = r["breakdown"]
            how = (f"recovery_finished total {b.get('reported_total', 0):.2f} s (transfer {b.get('transfer', 0):.3f} s, "
                   f"rebuild {b.get('rebuild', 0):.3f} s, {b.get('bytes', 0) / 1e6:.2f} MB), respawn "
                   f"{b.get('respawn', 0):.2f} s, set-up {b.get('setup', 0):.2f} s, retried step {b.get('retried', 0):.2f} s"
                   if launcher == "ftrun" else
                   f"restart {_fmt(b.get('restart'))} s + recompute {_fmt(b.get('recompute'))} s ({r['recomputed']} steps again)")
            out.append(f"  {launcher}: killed at step {r['case']['kill_step']}, failed step {r['failed_step']}, recovered in "
                       f"{_fmt(r['recover_s'])} s: {how}; wall time lost against the fault-free run {_fmt(lost[launcher][0])} s "
                       f"({_fmt(lost[launcher][1])} s at its own pace)")
        pair = {"recovery": _ratio(tr.get(k, {}).get("recover_s"), ft.get(k, {}).get("recover_s")),
                "restart": _ratio(tr.get(k, {}).get("breakdown", {}).get("restart"), ft.get(k, {}).get("recover_s")),
                "lost": _ratio(lost["torchrun"][0], lost["ftrun"][0]),
                "lost_paced": _ratio(lost["torchrun"][1], lost["ftrun"][1]),
                "step": _ratio(ft0.get(k, {}).get("step_s"), tr0.get(k, {}).get("step_s")),
                "step_faulted": _ratio(ft.get(k, {}).get("step_s"), tr.get(k, {}).get("step_s")),
                "cpu": _ratio(ft0.get(k, {}).get("rank_cpu_s"), tr0.get(k, {}).get("rank_cpu_s"))}
        for name, value in pair.items():
            if value is not None:
                ratios[name].append(value)
        steps = (f"fault-free step {_fmt((ft0[k]['step_s'] or 0) * 1e3, 1)} ms against {_fmt((tr0[k]['step_s'] or 0) * 1e3, 1)} ms"
                 if k in ft0 and k in tr0 else "fault-free step: no pair")
        cpu = [(r.get("rank_cpu_s") or 0) * 1e3 for r in (ft0.get(k, {}), tr0.get(k, {}))]
        out.append(f"  torchrun/ftrun: recovery {_x(pair['recovery'])}, torchrun's restart alone (its best case, a "
                   f"checkpoint at the failed step) {_x(pair['restart'])}, wall time lost {_x(pair['lost'])} "
                   f"({_x(pair['lost_paced'])} at each run's pace); {steps}, ftrun/torchrun {_x(pair['step'])} "
                   f"(the faulted pair's steps away from the fault: {_x(pair['step_faulted'])}); a rank's CPU a "
                   f"fault-free step {_fmt(cpu[0] or None, 1)} ms against {_fmt(cpu[1] or None, 1)} ms, {_x(pair['cpu'])}")
    faulted = [r for r in runs if r["case"]["kill_step"] is not None]
    same = {l: sum(1 for r in faulted if r["launcher"] == l and _digest(r["final"]) in reference) for l in LAUNCHERS}
    count = {l: sum(1 for r in faulted if r["launcher"] == l) for l in LAUNCHERS}
    out.append("params_sha256 of the fault-free runs: " + (", ".join(d[:16] for d in reference) or "-")
               + (" (they differ)" if len(reference) > 1 else "") + "; faulted runs ending with it: "
               + ", ".join(f"{l} {same[l]}/{count[l]}" for l in LAUNCHERS))
    out.append("medians of the pairs: " + ", ".join(f"{name} {_x(_med(values))}" for name, values in ratios.items())
               + " (recovery, restart, lost, lost_paced: torchrun/ftrun; step, step_faulted, cpu: ftrun/torchrun)")
    return out


def memory_table(runs: list[dict[str, Any]]) -> list[str]:
    """Peak RSS (MB, median over repeats) of launcher, supervisor and the largest rank by world size."""
    out = [f"{'case':<18} {'ft_launcher':>11} {'ft_superv':>9} {'ft_rank':>8} {'ft_spare':>8} {'tr_launcher':>11} {'tr_rank':>8}"]
    for key, group in _groups(runs).items():
        def peak(launcher: str, role: str) -> str:
            return _fmt(_med([r["peak_rss_mb"].get(role) for r in group[launcher]]), 0)

        out.append(f"{_label(key):<18} {peak('ftrun', 'launcher'):>11} {peak('ftrun', 'supervisor'):>9} "
                   f"{peak('ftrun', 'rank'):>8} {peak('ftrun', 'spare'):>8} {peak('torchrun', 'launcher'):>11} "
                   f"{peak('torchrun', 'rank'):>8}")
    return out


def report(results: dict[str, Any]) -> str:
    """All tables, as text."""
    m = results["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GiB, {m['os']}, Python {m['python']}, "
             f"torch {m['torch']}; ftrun {m.get('ftrun_commit', '?')}; load average at start {m['load_avg_at_start']}",
             f"command: {results['command']}"]
    parts = results["parts"]
    for part in ("recovery", "scaling-world", "scaling-state"):
        if part in parts:
            lines += ["", f"== {part}: SIGKILL of one rank from outside; recovery time (x/ft: torchrun/ftrun, pairwise median)"]
            lines += fault_table(parts[part])
            lines += ["", f"== {part}: where ftrun's recovery time goes (medians, seconds)"]
            lines += breakdown_table(parts[part])
    if "multinode" in parts:
        lines += ["", "== multinode: 2 hosts (network namespaces) x 2 ranks, one launcher per host; SIGKILL of rank 3 "
                      "from outside; recovery time (x/ft: torchrun/ftrun, pairwise median)"]
        lines += fault_table(parts["multinode"])
        lines += ["", "== multinode: where ftrun's recovery time goes (medians, seconds)"]
        lines += breakdown_table(parts["multinode"])
        lines += [""] + multinode_notes(parts["multinode"], results.get("multinode_reference", []))
    elif results.get("skipped", {}).get("multinode"):
        lines += ["", f"== multinode: skipped: {results['skipped']['multinode']}"]
    if "nodeloss" in parts:
        standby = any(r["case"].get("hot") for r in parts["nodeloss"])
        host0 = any(r["case"].get("lost_node") == 0 for r in parts["nodeloss"])
        lines += ["", "== nodeloss: 2 hosts x 2 ranks; every process of host 1 (host0: of host 0) SIGKILLed from outside, "
                      + ("ftrun: a standby node (same command, no --node_rank) on host 2 since the job trains, its hot "
                         "spares ready; torchrun: a replacement agent started at once on host 2" if standby else
                         "a replacement launcher (same command, --node_rank 1) started at once on host 2")
                      + ("; host0: ftrun's standby coordinator (node 1) takes over and the standby node takes "
                         "index 0, torchrun's whole job starts again at once on hosts 1 and 2 from its checkpoint"
                         if host0 else "")
                      + "; recovery time (x/ft: torchrun/ftrun, pairwise median)"]
        lines += fault_table(parts["nodeloss"])
        lines += ["", "== nodeloss: where the recovery time goes (medians, seconds)"]
        lines += nodeloss_table(parts["nodeloss"])
        lines += [""] + multinode_notes(parts["nodeloss"], results.get("nodeloss_reference", []))
        lines += nodeloss_pid_notes(parts["nodeloss"])
    elif results.get("skipped", {}).get("nodeloss"):
        lines += ["", f"== nodeloss: skipped: {results['skipped']['nodeloss']}"]
    if "elastic" in parts:
        lines += ["", "== elastic: 3 hosts x 2 ranks, --nnodes 2:3; every process of host 2 SIGKILLed from outside, no "
                      "replacement. ftrun: ranks 4 and 5 start on hosts 0 and 1 after --replace_timeout 3 s (the same "
                      "6 ranks); torchrun: every worker restarted on the 2 hosts left (a world of 4) from its checkpoint; "
                      "time from the kill to the failed step trained again (x/ft: torchrun/ftrun, pairwise median)"]
        lines += fault_table(parts["elastic"])
        lines += ["", "== elastic: where ftrun's time goes (medians, seconds)"]
        lines += elastic_table(parts["elastic"])
        lines += [""] + multinode_notes(parts["elastic"], results.get("elastic_reference", []))
    elif results.get("skipped", {}).get("elastic"):
        lines += ["", f"== elastic: skipped: {results['skipped']['elastic']}"]
    if "hf" in parts:
        lines += ["", "== hf: Hugging Face Trainer (examples/hf_trainer.py, a GRU LM, gradient accumulation 2), 4 ranks; "
                      "SIGKILL of rank 1 from outside. ftrun: with the integration (FTTrainer, rank-level recovery); "
                      "ftrun-restart and torchrun: the plain Trainer, a whole-job restart resuming from the Trainer's "
                      "newest checkpoint (ftrun.integrations.hf_resume); recovery time (x/ft: pairwise median ratio)"]
        lines += fault_table(parts["hf"])
        lines += digest_notes(parts["hf"])
    if "fsdp" in parts:
        faulted = [r for r in parts["fsdp"] if r["case"]["kill_step"] is not None]
        clean = [r for r in parts["fsdp"] if r["case"]["kill_step"] is None]
        lines += ["", "== fsdp: examples/train_fsdp.py --mesh 2,2 (FSDP2, HSDP: 2 replica groups x 2 shards), 4 ranks, gloo; "
                      "rank 3 SIGKILLed from outside halfway. ftrun: rank 3 alone respawned, its shards and AdamW state "
                      "from its replica (rank 1); torchrun: train_fsdp_torchrun.py, --max-restarts 1, no checkpoint: every "
                      "rank again from step 0, the steps redone inside recover_s (x/ft: torchrun/ftrun, pairwise median)"]
        lines += fault_table(faulted)
        lines += ["", "== fsdp: where the recovery time goes (medians, seconds)"]
        lines += breakdown_table(faulted)
        lines += ["", "== fsdp: fault-free step time, ftrun against the twin under torchrun (pairwise median; order "
                      "alternating by repeat)"]
        lines += overhead_table(clean)
        lines += [""] + fsdp_notes(parts["fsdp"])
    if "overhead" in parts:
        lines += ["", "== overhead: fault-free step time, ftrun against plain torchrun DDP (pairwise median)"]
        lines += overhead_table(parts["overhead"])
    if "overhead-real" in parts:
        lines += ["", "== overhead-real: fault-free step time of examples/word_lm.py (4 ranks) against its plain-DDP "
                      "twin under torchrun (pairwise median; steady state from step `from`: after the first epoch "
                      "and once ftrun's warm spare had imported torch, the same steps in each pair; the first "
                      "epoch's own pairwise overhead in first_epoch, the steps between it and `from` in "
                      "spare_window; cpu_*: rank 0's training thread, CPU ms a step, and ftrun's extra, pairwise)"]
        lines += overhead_table(parts["overhead-real"])
    if results.get("transfer"):
        lines += ["", "== transfer: ftrun.rank.transfer between two otherwise idle processes over gloo, no training "
                      "(into: into tensors the recipient has; fresh: into new ones)"]
        lines += transfer_table(results["transfer"])
    if results.get("errors"):
        lines += ["", f"{len(results['errors'])} run(s) failed and are left out; their output is under 'errors' in the JSON"]
    memory_runs = parts.get("memory") or parts.get("scaling-world")
    if memory_runs:
        lines += ["", "== memory: peak RSS (VmHWM) in MB by world size"]
        lines += memory_table(memory_runs)
    return "\n".join(lines)


def _digest(final: str | None) -> str | None:
    match = FINAL.search(final or "")
    return match.group(3) if match else None


def multinode_notes(runs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[str]:
    """Per launcher: the pairwise ratios, where the victim ran, and whether each faulted run ended
    with the parameters (params_sha256) of the same launcher's fault-free run."""
    out = []
    for key, group in _groups(runs).items():
        ft = {r["repeat"]: r["recover_s"] for r in group["ftrun"]}
        tr = {r["repeat"]: r["recover_s"] for r in group["torchrun"]}
        pairs = [f"{tr[k] / ft[k]:.2f}x" for k in sorted(ft) if k in tr and ft[k] and tr[k]]
        out.append(f"{_label(key)}: torchrun/ftrun per pair: {', '.join(pairs) or '-'}")
    for launcher in LAUNCHERS:
        faulted = [r for r in runs if r["launcher"] == launcher]
        ref = sorted({d for r in refs if r["launcher"] == launcher and (d := _digest(r["final"]))})
        nodes = sorted({r.get("victim_node") for r in faulted if r.get("victim_node") is not None})
        same = sum(1 for r in faulted if _digest(r["final"]) in ref)
        faulted_digests = sorted({d[:16] for r in faulted if (d := _digest(r["final"]))})
        out.append(f"{launcher}: victim on node(s) {nodes or '-'}; params_sha256 equal to the fault-free "
                   f"{launcher} run's: {same}/{len(faulted)}" + ("" if ref else " (no reference run)")
                   + (f"; reference {', '.join(d[:16] for d in ref)}" if ref else "")
                   + (" (references disagree)" if len(ref) > 1 else "")
                   + f"; faulted runs {', '.join(faulted_digests) or '-'}")
    return out


def plot(results: dict[str, Any], directory: Path) -> list[Path]:
    """PNG figures of recovery time against world size and against state size, both launchers.

    matplotlib is imported here, so the package does not depend on it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    specs = [("scaling-world", "ranks", "world size (ranks)", "recovery_vs_world_size.png", False),
             ("scaling-state", "state_mb", "training state (MB, params + AdamW moments)", "recovery_vs_state_size.png", True)]
    for part, xkey, xlabel, name, logx in specs:
        runs = results["parts"].get(part)
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for launcher, marker in zip(LAUNCHERS, ("o", "s")):
            points: dict[float, list[float]] = {}
            for r in runs:
                if r["launcher"] == launcher and r["recover_s"] is not None:
                    x = r["case"]["ranks"] if xkey == "ranks" else r["state_mb"]
                    points.setdefault(x, []).append(r["recover_s"])
            xs = sorted(points)
            med = [statistics.median(points[x]) for x in xs]
            lo = [m - min(points[x]) for m, x in zip(med, xs)]
            hi = [max(points[x]) - m for m, x in zip(med, xs)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker=marker, capsize=3, label=f"{launcher}" + (" (ARF)" if launcher == "ftrun" else " (restart + checkpoint)"))
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("recovery time (s): kill -> failed step done")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{part}: median, bars = min..max")
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    runs = [r for r in results["parts"].get("scaling-state", []) if r["launcher"] == "ftrun" and r["breakdown"].get("transfer")]
    if runs:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["breakdown"]["bytes"] / 1e6 for r in runs]
        ax.loglog(xs, [r["breakdown"]["transfer"] for r in runs], "o", label="ftrun state transfer")
        ref = sorted(xs)
        ax.loglog(ref, [x / 1e3 for x in ref], "--", color="gray", label="1 GB/s")
        ax.set_xlabel("state transferred (MB)")
        ax.set_ylabel("transfer time (s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        ax.set_title("ftrun: state transfer time against state size")
        fig.tight_layout()
        path = directory / "transfer_vs_state_size.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def transfer_worker(rank: int, port: int, sizes_mb: list[float], repeats: int) -> None:
    """One side of the raw transfer measurement: rank 0 sends ``ftrun.rank.transfer`` states of each
    size to rank 1, which receives them into tensors it already has ("into") and into none ("fresh",
    what a respawned rank's optimizer state does). Rank 1 prints one JSON line per measurement."""
    import torch
    import torch.distributed as dist

    from ftrun.rank.transfer import recv_state, send_state

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    for size in sizes_mb:
        tensors = max(1, int(size / 4))  # 4 MB tensors, like a model's layers
        state = {"model": {f"w{i}": torch.full((int(size * 1e6 / 4 / tensors),), float(rank)) for i in range(tensors)}}
        for mode in ("into", "fresh"):
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                if rank == 0:
                    nbytes = send_state(state, 1)
                else:
                    _, nbytes = recv_state(0, state if mode == "into" else {})
                seconds = time.perf_counter() - started
                if rank == 1:
                    print(json.dumps({"mb": nbytes / 1e6, "mode": mode, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


def run_transfer(sizes_mb: list[float], repeats: int) -> list[dict[str, Any]]:
    """Raw state-transfer throughput between two idle processes over gloo (no training)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sizes = ",".join(str(x) for x in sizes_mb)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_transfer_worker"]
    procs = [subprocess.Popen([*cmd, f"{rank},{port},{sizes},{repeats}"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in (0, 1)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"transfer measurement failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(line) for line in out[1].splitlines() if line.startswith("{")]


def transfer_table(rows: list[dict[str, Any]]) -> list[str]:
    """Median seconds and GB/s per size and mode."""
    out = [f"{'state_MB':>8} {'mode':<6} {'seconds':>8} {'GB/s':>6}"]
    keys = sorted({(round(r["mb"], 1), r["mode"]) for r in rows}, key=lambda k: (k[0], k[1] != "into"))
    for mb, mode in keys:
        sec = statistics.median(r["seconds"] for r in rows if round(r["mb"], 1) == mb and r["mode"] == mode)
        out.append(f"{mb:>8.1f} {mode:<6} {sec:>8.3f} {mb / 1e3 / sec:>6.2f}")
    return out


def merge(many: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one: runs of the same part are pooled, commands joined by ' ; '."""
    out: dict[str, Any] = {"machine": many[0]["machine"], "command": " ; ".join(r["command"] for r in many), "parts": {}}
    for index, results in enumerate(many):
        for part, runs in results["parts"].items():
            # Pairs are matched by repeat index: keep each file's pairs apart.
            out["parts"].setdefault(part, []).extend(r | {"repeat": index * 1000 + r["repeat"]} for r in runs)
        out.setdefault("errors", []).extend(results.get("errors", []))
        out.setdefault("transfer", []).extend(results.get("transfer", []))
        out.setdefault("multinode_reference", []).extend(results.get("multinode_reference", []))
        out.setdefault("nodeloss_reference", []).extend(results.get("nodeloss_reference", []))
        out.setdefault("skipped", {}).update(results.get("skipped", {}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each recovery, overhead, multinode, nodeloss, elastic, hf and fsdp case per launcher "
                             "(default 2, multinode and overhead-real 3)")
    parser.add_argument("--scaling_repeats", type=int, default=1,
                        help="runs of each case of scaling-world, scaling-state and memory (default 1)")
    parser.add_argument("--quick", action="store_true", help="short jobs, small worlds and sizes: a smoke run")
    parser.add_argument("--hot", action="store_true", help="scaling-world with ftrun's hot spares (--hot_spares 1)")
    parser.add_argument("--lost-hosts", dest="lost_hosts", default="1",
                        help="nodeloss: the host(s) killed, comma-separated: 1 (default), 0 (the coordinator's: ftrun's "
                             "standby coordinator takes over; torchrun's whole job starts again on the others)")
    parser.add_argument("--standby", action="store_true",
                        help="nodeloss with a standby node (ftrun launcher started before the loss, its hot spares ready)")
    parser.add_argument("--only", default=None,
                        help="only the cases whose label contains this text, e.g. 'hot early' (the table's case column)")
    parser.add_argument("--fsdp_steps", type=int, default=None,
                        help=f"fsdp: steps of each job, the kill at half of them (default {FSDP_STEPS}, --quick 60)")
    parser.add_argument("--worlds", default="2,4,8,16", help="world sizes of scaling-world (default 2,4,8,16)")
    parser.add_argument("--sizes", default="tiny,small,medium,large,xl", help="charlm sizes of scaling-state")
    parser.add_argument("--json", default="bench_results.json", help="raw results file ('' for none)")
    parser.add_argument("--plots", default=None, help="write PNG figures to this directory (needs matplotlib)")
    parser.add_argument("--from_json", default=None, help="report (and plot) previous runs' JSON files (comma-separated, pooled); run nothing")
    parser.add_argument("--_transfer_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._transfer_worker:
        rank, port, *sizes, repeats = args._transfer_worker.split(",")  # RANK,PORT,MB,...,REPEATS
        transfer_worker(int(rank), int(port), [float(x) for x in sizes], int(repeats))
        return
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    try:
        args.lost_nodes = [None if int(h) == 1 else int(h) for h in args.lost_hosts.split(",") if h.strip()]
    except ValueError:
        parser.error(f"--lost-hosts {args.lost_hosts}: comma-separated host numbers, 0 or 1")
    if not args.lost_nodes or any(h not in (None, 0) for h in args.lost_nodes):
        parser.error(f"--lost-hosts {args.lost_hosts}: choose 0, 1 or 0,1")
    if args.fsdp_steps is not None and args.fsdp_steps < 10:
        parser.error(f"--fsdp_steps {args.fsdp_steps}: at least 10 (the kill comes at half of them)")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.from_json:
        results = merge([json.loads(Path(f).read_text()) for f in args.from_json.split(",")])
    else:
        results = run_all(args)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(report(results))
    if args.plots:
        for path in plot(results, Path(args.plots)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

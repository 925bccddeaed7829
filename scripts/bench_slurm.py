"""A node lost under Slurm: ftrun (examples/deploy/ftrun.sbatch) against plain `srun torchrun`
(scripts/torchrun_slurm.sbatch), on the same Slurm 22.05 cluster; the time from the loss to training again.

    .venv/bin/python scripts/bench_slurm.py --repeats 2             # as root; prints the table
    .venv/bin/python scripts/bench_slurm.py --repeats 2 --json /tmp/bench_slurm.json

The cluster is tests/slurmcluster.py's (slurmctld and three slurmd, each node a network-namespace
host; needs root and Debian's slurm-wlm, else one line says why and the script exits 2). Each
repeat runs ftrun, then torchrun, back to back: one batch job of 3 nodes (2 training nodes x 2
ranks of the digits job, ``--log_every 1``, and the spare node), submitted with ``sbatch`` as a
user would. When rank 0 prints step ``--kill_step``, node 1's host loses its link and every
process on it is SIGKILLed, slurmd included (:meth:`SlurmCluster.kill_node`: a machine losing
power). Neither launcher is told anything: the spare node's launcher, already waiting in the job,
replaces node 1.

Figures (seconds from the kill, wall clock; rank 0's step lines carry their own timestamps):

- ``training_again``: ftrun, node 0's ``recovery_finished`` event (the replacement's ranks have the
  state, the group is rebuilt); torchrun, the first step rank 0 logs after the restart (every rank
  restarted from the last checkpoint of train_digits_torchrun.py, ``--ckpt_every 25``).
- ``recover``: to the step that failed done again (as scripts/bench.py measures), so torchrun's
  recomputed steps count; ``recomputed`` is how many.
- ftrun's split from node 0's events (scripts/bench.py's ``nodeloss_breakdown``): detection (kill
  to ``node_lost``), join (to the spare's ``node_joined``), recovery (to ``recovery_finished``).

Every job's final ``params_sha256`` is compared with a fault-free ftrun run of the same job on host
0 (``tests/digits_job.py``'s command, in the host's namespace). Only addresses inside the
namespaces receive traffic. Everything the script made is removed at the end, on failure too; a
failed job's directory is kept (its path is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402  (STEP, FINAL, Case, Run, analyse_fault, nodeloss_breakdown)
import digits_job as dj  # noqa: E402
import slurmcluster  # noqa: E402

LAUNCHERS = ("ftrun", "torchrun")
SBATCH = {"ftrun": ROOT / "examples" / "deploy" / "ftrun.sbatch", "torchrun": ROOT / "scripts" / "torchrun_slurm.sbatch"}
OUTPUT = {"ftrun": "ftrun-{}.out", "torchrun": "torchrun-{}.out"}  # each script's --output
TORCHRUN_SCRIPT = ROOT / "examples" / "train_digits_torchrun.py"
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")


def submit(cluster: slurmcluster.SlurmCluster, launcher: str, workdir: Path, steps: int, ckpt_every: int) -> str:
    """Submit one job of ``launcher`` from ``workdir``; returns its id."""
    env = dj.env({"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                  "PYTHONUNBUFFERED": "1"})
    if launcher == "ftrun":
        env["FTRUN_LOCAL_WORKER_NUM"] = "2"
        train = [str(dj.SCRIPT), "--steps", str(steps), "--log_every", "1"]
    else:
        env = cluster.hosts[0].env(env)  # GLOO_SOCKET_IFNAME=eth0: the hosts' interface
        env["NPROC_PER_NODE"] = "2"
        env["LOGLEVEL"] = "INFO"  # torchrun's agents say why they restart
        train = [str(TORCHRUN_SCRIPT), "--steps", str(steps), "--log_every", "1",
                 "--ckpt_dir", str(workdir / "ckpt"), "--ckpt_every", str(ckpt_every)]
    proc = cluster.cmd(["sbatch", "--parsable", str(SBATCH[launcher]), *train], cwd=workdir, env=env, timeout=60)
    job = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not re.fullmatch(r"\d+", job):
        raise RuntimeError(f"sbatch failed: {proc.stdout}{proc.stderr}")
    return job


def step_lines(text: str) -> list[tuple[int, float]]:
    """(step, rank 0's time) of every step line in a job's output."""
    return [(int(m.group(1)), float(m.group(2))) for m in bench.STEP.finditer(text)]


def victim_host(cluster: slurmcluster.SlurmCluster, launcher: str, workdir: Path, job: str) -> str:
    """Node name of training node 1's host: ftrun's rank 2 runs there; torchrun's other training
    host is the one, besides the rendezvous host (the job's first), that runs training processes."""
    if launcher == "ftrun":
        rank2 = dj.started(dj.events(workdir / "ftrun_logs" / job))[2][0]
        return next(name for name, host in cluster.nodes.items() if rank2 in host.pids())
    first = cluster.cmd(["squeue", "-h", "-j", job, "-o", "%N"], timeout=30).stdout.strip()
    first = cluster.cmd(["scontrol", "show", "hostnames", first], timeout=30).stdout.split()[0]
    for name, host in cluster.nodes.items():
        if name != first and any(_is_torchrun_worker(pid) for pid in host.pids()):
            return name
    raise RuntimeError("no torchrun training host besides the rendezvous host")


def _is_torchrun_worker(pid: int) -> bool:
    """A rank started by torchrun's agent (the agent's own command line names the script too,
    the waiting spare's included; only its workers have LOCAL_RANK)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return TORCHRUN_SCRIPT.name in cmdline and any(item.startswith(b"LOCAL_RANK=") for item in environ)


def run_once(cluster: slurmcluster.SlurmCluster, launcher: str, repeat: int, args: argparse.Namespace,
             reference: str | None) -> dict[str, Any]:
    """One job of ``launcher`` with node 1 killed at ``args.kill_step``: its figures (see the module docstring)."""
    cluster.restore()
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-slurm-{launcher}-"))
    job = submit(cluster, launcher, workdir, args.steps, args.ckpt_every)
    out = workdir / OUTPUT[launcher].format(job)
    submitted = time.time()
    try:
        deadline = time.monotonic() + args.timeout
        while not any(s >= args.kill_step for s, _ in step_lines(out.read_text(errors="replace") if out.exists() else "")):
            if time.monotonic() > deadline or cluster.job_state(job) not in ACTIVE:
                raise RuntimeError(f"{launcher} job {job} did not reach step {args.kill_step}")
            time.sleep(0.05)
        victim = victim_host(cluster, launcher, workdir, job)
        killed_at = cluster.kill_node(victim)
        while (state := cluster.job_state(job)) in ACTIVE:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{launcher} job {job} still {state} after {args.timeout} s")
            time.sleep(0.5)
        text = out.read_text(errors="replace")
        final = bench.FINAL.search(text)
        if state != "COMPLETED" or final is None:
            raise RuntimeError(f"{launcher} job {job} ended {state}, final line {'found' if final else 'missing'}")
        case = bench.Case("digits", "-", 4, args.steps, args.kill_step, ckpt_every=args.ckpt_every, nodes=2)
        run = bench.Run(launcher, case, total_s=time.time() - submitted, step_s=None, final=final.group(0))
        bench.analyse_fault(run, sorted(step_lines(text), key=lambda x: x[1]), killed_at, None)
        result: dict[str, Any] = {
            "launcher": launcher, "repeat": repeat, "job": job, "victim": victim, "state": state, "killed_at": killed_at,
            "recover_s": round(run.recover_s or 0.0, 3), "recomputed": run.recomputed, "failed_step": run.failed_step,
            "params_sha256": final.group(3), "equal_to_fault_free": None if reference is None else final.group(3) == reference,
        }
        if launcher == "ftrun":
            events_path = workdir / "ftrun_logs" / job / "events.jsonl"
            split = bench.nodeloss_breakdown(events_path, killed_at, killed_at + (run.recover_s or 0.0))
            result["training_again_s"] = round(split["detection"] + split["join"] + split["recovery"], 3)
            result["split"] = {k: split[k] for k in ("detection", "join", "recovery", "transfer", "retried")}
            pids = dj.started(dj.events(events_path.parent))
            result["survivors_kept_pids"] = len(pids[0]) == 1 and len(pids[1]) == 1
        else:
            before = max(s for s, t in step_lines(text) if t <= killed_at)
            if not any(s <= before and t > killed_at for s, t in step_lines(text)):
                raise RuntimeError(f"torchrun job {job}: no restart from a checkpoint after the kill of {victim}")
            result["training_again_s"] = round(run.breakdown["restart"], 3)
            # The agents' own log: when node 0's agent saw the spare waiting (the lost node's
            # rendezvous heartbeats expired) and stopped its workers to restart with it.
            detected = next((_log_time(line, killed_at) for line in text.splitlines()
                             if "new nodes" in line and _log_time(line, killed_at) > killed_at), None)
            split = {"detection": detected - killed_at} if detected else {}
            if detected:
                split["restart"] = run.breakdown["restart"] - split["detection"]
            result["split"] = {k: round(v, 3) for k, v in {**split, "recompute": run.breakdown["recompute"]}.items()}
        # What the launchers said about the loss (torchrun's agents, ftrun's node 0), for the record.
        said = re.compile(r"rendezvous|restart|new nodes|stopping|node_lost|node \d (lost|joined)|recover", re.I)
        result["said"] = [line[:300] for line in text.splitlines() if said.search(line) and not bench.STEP.search(line)][:40]
        shutil.rmtree(workdir, ignore_errors=True)
        return result
    except BaseException as exc:
        for left in cluster.cmd(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split():
            cluster.cmd(["scancel", left], timeout=30)
        if isinstance(exc, RuntimeError):
            tail = (out.read_text(errors="replace") if out.exists() else "")[-3000:]
            raise RuntimeError(f"{exc} (directory kept: {workdir})\n{tail}") from None
        raise
    finally:
        # The job's leftovers (the lost node's step, the spare's) end with it; wait until they did.
        waited = time.monotonic() + 60
        while cluster.cmd(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split() and time.monotonic() < waited:
            time.sleep(0.5)


def _log_time(line: str, near: float) -> float:
    """Wall-clock time of a torch log line (``I1124 04:49:05.572000 ...``: local time of day) on
    the day of ``near``; 0.0 if the line has none."""
    match = re.match(r"[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)", line)
    if not match:
        return 0.0
    day = time.localtime(near)
    midnight = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, 0, 0, 0, 0, 0, -1))
    return midnight + int(match.group(1)) * 3600 + int(match.group(2)) * 60 + float(match.group(3))


def fault_free_digest(cluster: slurmcluster.SlurmCluster, steps: int) -> str:
    """params_sha256 of the fault-free 4-rank ftrun job on host 0 (one node, in its namespace)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-slurm-reference-"))
    try:
        proc = cluster.hosts[0].run(dj.cmd(workdir / "logs", str(steps)), timeout=400, env=dj.env(), cwd=workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"the fault-free run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
        return dj.digest(proc.stdout, str(steps))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def table(results: list[dict[str, Any]]) -> list[str]:
    """One line per run, then medians and the pairwise torchrun/ftrun ratio of training_again."""
    lines = [f"{'launcher':<9} {'repeat':>6} {'training_again_s':>16} {'recover_s':>9} {'recomputed':>10} "
             f"{'fault-free digest':>17}  split"]
    for r in results:
        split = " ".join(f"{k}={v:g}" for k, v in r["split"].items())
        lines.append(f"{r['launcher']:<9} {r['repeat']:>6} {r['training_again_s']:>16.2f} {r['recover_s']:>9.2f} "
                     f"{r['recomputed']:>10} {str(r['equal_to_fault_free']):>17}  {split}")
    lines.append("")
    by = {(r["launcher"], r["repeat"]): r for r in results}
    for launcher in LAUNCHERS:
        values = [r["training_again_s"] for r in results if r["launcher"] == launcher]
        if values:
            lines.append(f"{launcher}: training again after the loss, median {statistics.median(values):.2f} s "
                         f"(runs: {', '.join(f'{v:.2f}' for v in values)})")
    ratios = [by[("torchrun", rep)]["training_again_s"] / by[("ftrun", rep)]["training_again_s"]
              for rep in sorted({r["repeat"] for r in results}) if ("torchrun", rep) in by and ("ftrun", rep) in by]
    if ratios:
        lines.append(f"torchrun/ftrun per pair: {', '.join(f'{x:.2f}x' for x in ratios)}; "
                     f"median {statistics.median(ratios):.2f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (ftrun, then torchrun)")
    parser.add_argument("--steps", type=int, default=200, help="steps of the digits job")
    parser.add_argument("--kill_step", type=int, default=60, help="node 1 is lost when rank 0 prints this step")
    parser.add_argument("--ckpt_every", type=int, default=25, help="torchrun's checkpoint interval (steps)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds one job may take")
    parser.add_argument("--no_reference", action="store_true", help="skip the fault-free run (no digest check)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="which launchers, in order (default: ftrun,torchrun)")
    parser.add_argument("--json", default="", help="write the runs to this file")
    args = parser.parse_args()
    if not set(args.launchers.split(",")) <= set(LAUNCHERS):
        parser.error(f"--launchers: one or more of {', '.join(LAUNCHERS)}")
    reason = slurmcluster.unavailable_reason(install=False)
    if reason is not None:
        print(f"bench_slurm: {reason}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    cluster = slurmcluster.SlurmCluster(3)
    try:
        reference = None if args.no_reference else fault_free_digest(cluster, args.steps)
        print(f"fault-free params_sha256 ({args.steps} steps): {reference}", flush=True)
        for repeat in range(1, args.repeats + 1):
            for launcher in args.launchers.split(","):
                result = run_once(cluster, launcher, repeat, args, reference)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        cluster.close()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n".join(["", f"== node 1 of 2 lost (link cut, every process SIGKILLed) at step {args.kill_step} of "
                     f"{args.steps}; the job's spare node replaces it (seconds from the kill)", *table(results)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

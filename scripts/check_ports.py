"""Every fault scenario of the two ported pytorch/examples scripts, each run N times, in one table.

    python scripts/check_ports.py [--repeats 3] [--only dcgan] [--keep DIR]

The ports (examples/dcgan.py on 4 ranks: two nets with BatchNorm in DDP, two optimizers, three
backward passes and two updates a step; examples/time_sequence_prediction.py on 2 ranks: LBFGS,
whose ``step(closure)`` runs up to 20 forward and backward passes, each with its all-reduce) and
their torchrun twins. tests/test_ports.py runs four of these in the suite; the rest is here, too
long for it (a repeat takes about 20 minutes on 2 cores):

- the twin under torchrun (its digest is the bar; every repeat must give the same one);
- the port fault-free, also with ``--on_divergence fail``;
- kills injected (``FTRUN_FAULT``) at every point of a mid-epoch step: before the forward, in each
  all-reduce (``nth``: DCGAN's D on real, D on fake, G's backward through netD and through netG;
  LBFGS's closure calls), in each optimizer update, between steps; at an epoch's first and last
  steps; of rank 0 (whose BatchNorm buffers DDP broadcasts);
- a SIGKILL from outside, mid-epoch;
- tests/scripts/dcgan_netG_unregistered.py (netG not given to ftrun): fault-free it must report
  nothing, after a kill inside a step it must report a divergence;
- ``ftrun check`` of both ports (exit code 0) and of the unregistered variant (exit code 1).

For each run the table gives the exit code, whether the digest of the final line equals the twin's
and the port's fault-free run's, the number of ``divergence`` events, respawned ranks and whole-job
restarts, the wall time, and ``ok`` or what differs from the expectation. Exit code 0 when every
run met its expectation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT / "tests"))
from reference_runs import run_torchrun  # noqa: E402

FINAL = re.compile(r"final step=(\d+) loss=\S+ test_accuracy=\S+ params_sha256=([0-9a-f]{64})")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Port:
    """A ported script, its twin, its world size and the arguments of every run."""

    name: str
    script: str
    twin: str
    ranks: int
    args: tuple[str, ...]
    check_args: tuple[str, ...]  # smaller, for ftrun check's runs on 2 ranks


DCGAN = Port("dcgan", "dcgan.py", "dcgan_torchrun.py", 4, ("--niter", "3"),
             ("--nimages", "32", "--niter", "2"))  # 8 steps an epoch on 4 ranks: steps 0..23
TSP = Port("tsp", "time_sequence_prediction.py", "time_sequence_prediction_torchrun.py", 2,
           ("--steps", "3", "--length", "60"), ("--steps", "3", "--length", "30"))
UNREGISTERED = ROOT / "tests" / "scripts" / "dcgan_netG_unregistered.py"


@dataclass(frozen=True)
class Scenario:
    """One run and what it must give.

    Attributes:
        name: the table's first column.
        port: the port it runs.
        mode: ``twin`` (torchrun), ``ftrun``, ``outside_kill`` (SIGKILL of ``victim`` once rank 0's
            log shows ``kill_when``) or ``check`` (``ftrun check``).
        fault: ``FTRUN_FAULT``, if any.
        script: another script than the port's (the unregistered variant).
        ftrun_args: options of ftrun (or of ftrun check) before the script.
        expect_rc: the exit code it must end with.
        expect_twin: its digest must equal the twin's (None: not compared).
        expect_divergence: True: at least one divergence event; False: none; None: not looked at.
        faulted: one rank is killed: exactly one respawn and no whole-job restart are expected.
    """

    name: str
    port: Port
    mode: str = "ftrun"
    fault: str | None = None
    script: Path | None = None
    ftrun_args: tuple[str, ...] = ()
    kill_when: str = ""
    victim: int = 0
    expect_rc: int = 0
    expect_twin: bool | None = True
    expect_divergence: bool | None = False
    faulted: bool = False


def _kill(port: Port, rank: int, step: int, point: str, nth: int | None = None, what: str = "",
          script: Path | None = None, expect_twin: bool | None = True, expect_divergence: bool | None = False) -> Scenario:
    nth_key = f",nth={nth}" if nth is not None else ""
    label = f"{port.name}: kill rank {rank} at {point}{f' nth={nth}' if nth is not None else ''}, step {step}"
    return Scenario(f"{label}{f' ({what})' if what else ''}", port,
                    fault=f"rank={rank},step={step},point={point}{nth_key},kind=kill", script=script,
                    expect_twin=expect_twin, expect_divergence=expect_divergence, faulted=True)


def scenarios() -> list[Scenario]:
    """Every scenario, in the order they run."""
    out = [
        Scenario("dcgan: torchrun twin", DCGAN, mode="twin", expect_divergence=None),
        Scenario("dcgan: fault-free", DCGAN),
        Scenario("dcgan: fault-free, --on_divergence fail", DCGAN, ftrun_args=("--on_divergence", "fail")),
        _kill(DCGAN, 2, 11, "before_forward", what="mid-epoch"),
        _kill(DCGAN, 2, 11, "allreduce", 1, "D on real"),
        _kill(DCGAN, 2, 11, "allreduce", 2, "D on fake.detach()"),
        _kill(DCGAN, 2, 11, "allreduce", 3, "G's backward, netD"),
        _kill(DCGAN, 2, 11, "allreduce", 4, "G's backward, netG"),
        _kill(DCGAN, 2, 11, "optimizer", 1, "optimizerD"),
        _kill(DCGAN, 2, 11, "optimizer", 2, "optimizerG"),
        _kill(DCGAN, 2, 11, "between_steps", what="mid-epoch"),
        _kill(DCGAN, 2, 8, "before_forward", what="an epoch's first step"),
        _kill(DCGAN, 2, 8, "optimizer", 2, "an epoch's first step"),
        _kill(DCGAN, 2, 7, "optimizer", 2, "an epoch's last step"),
        _kill(DCGAN, 2, 7, "between_steps", what="after an epoch's last step"),
        _kill(DCGAN, 0, 11, "between_steps", what="rank 0: the buffers' source"),
        _kill(DCGAN, 0, 11, "allreduce", 3, "rank 0: the buffers' source"),
        Scenario("dcgan: SIGKILL of rank 2 from outside, mid-epoch", DCGAN, mode="outside_kill",
                 kill_when="[1/3][3/8]", victim=2, faulted=True),
        Scenario("dcgan netG unregistered: fault-free", DCGAN, script=UNREGISTERED, expect_twin=None),
        _kill(DCGAN, 2, 11, "allreduce", 3, "netG unregistered: must be reported", script=UNREGISTERED,
              expect_twin=None, expect_divergence=True),
        Scenario("tsp: torchrun twin", TSP, mode="twin", expect_divergence=None),
        Scenario("tsp: fault-free", TSP),
        Scenario("tsp: fault-free, --on_divergence fail", TSP, ftrun_args=("--on_divergence", "fail")),
        _kill(TSP, 1, 1, "before_forward"),
        _kill(TSP, 1, 1, "optimizer", 1, "before LBFGS's first closure call"),
        _kill(TSP, 1, 1, "allreduce", 1, "closure call 1"),
        _kill(TSP, 1, 1, "allreduce", 2, "closure call 2"),
        _kill(TSP, 1, 1, "allreduce", 3, "closure call 3"),
        _kill(TSP, 1, 1, "between_steps"),
        _kill(TSP, 1, 2, "allreduce", 2, "the last step"),
        _kill(TSP, 0, 1, "allreduce", 2, "rank 0"),
        Scenario("tsp: SIGKILL of rank 1 from outside, in step 1", TSP, mode="outside_kill", kill_when="STEP:  1",
                 victim=1, faulted=True),
        Scenario("dcgan: ftrun check (2 ranks)", DCGAN, mode="check", expect_twin=None, expect_divergence=None),
        Scenario("dcgan netG unregistered: ftrun check (2 ranks)", DCGAN, mode="check", script=UNREGISTERED,
                 expect_rc=1, expect_twin=None, expect_divergence=None),
        Scenario("tsp: ftrun check (2 ranks)", TSP, mode="check", expect_twin=None, expect_divergence=None),
    ]
    return out


@dataclass
class Result:
    """What one run gave."""

    rc: int | str
    digest: str | None = None
    divergences: int | None = None
    respawns: int | None = None
    job_restarts: int | None = None
    seconds: float = 0.0
    tail: str = ""
    notes: list[str] = field(default_factory=list)


def _env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env["FTRUN_FAULT"] = fault
    return env


def _events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _digest(out: str) -> str | None:
    match = FINAL.search(out)
    return match.group(2) if match else None


def _ftrun_cmd(scenario: Scenario, log_dir: Path) -> list[str]:
    port = scenario.port
    script = scenario.script or EXAMPLES / port.script
    return [sys.executable, "-m", "ftrun", "--worker_num", str(port.ranks), "--master_port", "0", "--plain",
            "--log_dir", str(log_dir), "--tail_worker_log", "0", "--max_restarts", "3", *scenario.ftrun_args,
            str(script), *port.args]


def _with_events(result: Result, log_dir: Path) -> Result:
    events = _events(log_dir)
    result.divergences = sum(1 for e in events if e["kind"] == "divergence")
    result.respawns = sum(1 for e in events if e["kind"] == "rank_respawned")
    result.job_restarts = sum(1 for e in events if e["kind"] == "job_restarting")
    return result


def _run_twin(scenario: Scenario, work: Path) -> Result:
    port = scenario.port
    started = time.monotonic()
    proc = run_torchrun(["--standalone", "--nproc_per_node", str(port.ranks), str(EXAMPLES / port.twin), *port.args],
                        env=_env(None), cwd=work, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    return Result(proc.returncode, _digest(out), seconds=time.monotonic() - started, tail=out[-3000:])


def _run_ftrun(scenario: Scenario, work: Path) -> Result:
    log_dir = work / "logs"
    started = time.monotonic()
    try:
        proc = subprocess.run(_ftrun_cmd(scenario, log_dir), env=_env(scenario.fault), capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=work)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return _with_events(Result("timeout", seconds=time.monotonic() - started, tail=out[-3000:]), log_dir)
    out = proc.stdout + proc.stderr
    return _with_events(Result(proc.returncode, _digest(out), seconds=time.monotonic() - started, tail=out[-3000:]),
                        log_dir)


def _run_outside_kill(scenario: Scenario, work: Path) -> Result:
    """SIGKILL of the victim's first process once rank 0's log shows ``kill_when``."""
    log_dir = work / "logs"
    started = time.monotonic()
    proc = subprocess.Popen(_ftrun_cmd(scenario, log_dir), env=_env(None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=work, start_new_session=True)
    note = ""
    try:
        log = log_dir / "worker_0.log"
        while not (log.exists() and scenario.kill_when in log.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() - started > TIMEOUT_S:
                note = f"{scenario.kill_when!r} never logged: nothing killed"
                break
            time.sleep(0.05)
        else:
            pid = next(e["pid"] for e in _events(log_dir) if e["kind"] == "rank_started" and e["rank"] == scenario.victim)
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - started)))
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        out, rc = "", "timeout"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = _with_events(Result(rc, _digest(out), seconds=time.monotonic() - started, tail=out[-3000:]), log_dir)
    if note:
        result.notes.append(note)
    return result


def _run_check(scenario: Scenario, work: Path) -> Result:
    port = scenario.port
    script = scenario.script or EXAMPLES / port.script
    args = list(port.check_args)
    if port is DCGAN:
        args += ["--outf", str(work / "out")]  # checkpoints in ft.section("save"): check's section scenario
    cmd = [sys.executable, "-m", "ftrun", "check", "--worker_num", "2", "--keep", str(work / "check"),
           *scenario.ftrun_args, str(script), *args]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=_env(None), capture_output=True, text=True, timeout=3 * TIMEOUT_S, cwd=work)
    except subprocess.TimeoutExpired:
        return Result("timeout", seconds=time.monotonic() - started)
    out = proc.stdout + proc.stderr
    result = Result(proc.returncode, seconds=time.monotonic() - started, tail=out[-3000:])
    result.notes += [line.strip() for line in out.splitlines() if line.strip().startswith(("FAIL", "ok", "ftrun check:"))]
    return result


RUNNERS = {"twin": _run_twin, "ftrun": _run_ftrun, "outside_kill": _run_outside_kill, "check": _run_check}


def mismatches(scenario: Scenario, result: Result, twin: str | None) -> list[str]:
    """What in ``result`` differs from ``scenario``'s expectation (empty: it met it)."""
    out = []
    if result.rc != scenario.expect_rc:
        out.append(f"exit {result.rc}, expected {scenario.expect_rc}")
    if scenario.mode == "twin" and twin is not None and result.digest != twin:
        out.append("twin's digest differs from the first repeat's")
    if scenario.mode != "twin" and scenario.expect_twin is not None and result.rc == scenario.expect_rc:
        if result.digest is None:
            out.append("no final line")
        elif twin is not None and (result.digest == twin) != scenario.expect_twin:
            out.append("digest differs from the twin's" if scenario.expect_twin else "digest equals the twin's")
    if scenario.expect_divergence is True and not result.divergences:
        out.append("no divergence reported")
    if scenario.expect_divergence is False and result.divergences:
        out.append(f"{result.divergences} divergence event(s)")
    if scenario.faulted and result.rc == scenario.expect_rc:
        if result.respawns != 1:
            out.append(f"{result.respawns} respawn(s), expected 1")
        if result.job_restarts:
            out.append(f"{result.job_restarts} whole-job restart(s)")
    return out


def _yes_no(digest: str | None, other: str | None) -> str:
    if digest is None or other is None:
        return "-"
    return "yes" if digest == other else "no"


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths))


HEADER = ["scenario", "rep", "exit", "=twin", "=fault-free", "div", "respawns", "job_rst", "s", "digest", "result"]
WIDTHS = [76, 3, 7, 5, 11, 4, 8, 7, 6, 12, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each scenario (default 3)")
    parser.add_argument("--only", default="", help="only scenarios whose name contains this text (e.g. dcgan, tsp, check)")
    parser.add_argument("--keep", default=None, help="keep every run's directory (logs, events) under DIR")
    parser.add_argument("--verbose", action="store_true", help="print the end of the output of each run that failed")
    args = parser.parse_args()

    chosen = [s for s in scenarios() if args.only in s.name]
    if not chosen:
        print(f"check_ports: no scenario matches {args.only!r}", file=sys.stderr)
        return 2
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="check_ports-"))
    base.mkdir(parents=True, exist_ok=True)
    twins: dict[str, str | None] = {}
    fault_free: dict[str, str | None] = {}
    rows: list[list[str]] = []
    failed = 0
    print(_row(HEADER, WIDTHS), flush=True)
    try:
        for repeat in range(1, args.repeats + 1):
            for i, scenario in enumerate(chosen):
                work = base / f"r{repeat}" / f"{i:02d}"
                work.mkdir(parents=True, exist_ok=True)
                result = RUNNERS[scenario.mode](scenario, work)
                key = scenario.port.name
                if scenario.mode == "twin" and key not in twins:
                    twins[key] = result.digest
                if scenario.mode == "ftrun" and scenario.script is None and not scenario.ftrun_args and not scenario.fault:
                    fault_free.setdefault(key, result.digest)
                wrong = mismatches(scenario, result, twins.get(key))
                failed += bool(wrong)
                cells = [scenario.name, str(repeat), str(result.rc), _yes_no(result.digest, twins.get(key)),
                         _yes_no(result.digest, fault_free.get(key)),
                         "-" if result.divergences is None else str(result.divergences),
                         "-" if result.respawns is None else str(result.respawns),
                         "-" if result.job_restarts is None else str(result.job_restarts),
                         f"{result.seconds:.0f}", (result.digest or "-")[:12], "; ".join(wrong) or "ok"]
                rows.append(cells)
                print(_row(cells, WIDTHS), flush=True)
                for note in result.notes:
                    print(f"      {note}", flush=True)
                if wrong and args.verbose:
                    print("      " + result.tail[-1500:].replace("\n", "\n      "), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print("twin digests: " + ", ".join(f"{k} {v}" for k, v in twins.items()))
    print(f"check_ports: {len(rows) - failed} of {len(rows)} run(s) as expected" + (f", {failed} not" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The GPU checks and measurements of ftrun's CUDA path, on one GPU (run by scripts/gpu_check.sh;
see docs/gpu.md).

Each check prints one line, ``PASS``, ``FAIL`` or, with ``--device cpu``, ``REHEARSED`` (the same
steps on the CPU with gloo: it proves the checks' own logic where no GPU is lent, and checks nothing
about CUDA). The JSON written to ``--out`` holds every check's status, figures and detail. The exit
code is 0 only when every check passed on a GPU; 1 when one failed; 3 when nothing ran on a GPU
(a rehearsal, or no GPU).

Checks (4 ranks share the GPU through gloo with CUDA tensors; NCCL cannot join two ranks on one GPU):
- digits_fault_free: the 4-rank digits job's digest equals plain DDP's under torchrun on the GPU;
- digits_outside_sigkill: a rank SIGKILLed from outside mid-run: digest equal, the survivors keep
  their processes (and their GPU memory, where NVML lists processes), the respawned rank's wait for
  its GPU's memory (seconds, from its log);
- digits_kill_at_allreduce, digits_recoverable: a kill inside the all-reduce; a recoverable error
  repaired in place (no respawn): digest equal;
- charlm_small: fault-free digest equal to its torchrun twin, and a kill at the all-reduce equal;
- hot_spare_promotion: a hot spare promoted after an outside SIGKILL (its CUDA context made before
  its promotion on one GPU): digest equal, the recovery's seconds;
- state_transfer_snapshot: charlm-medium state (parameters and AdamW moments) on the GPU: the
  snapshot's cost (first, then into reused pinned buffers) and a transfer between two processes
  (GB/s), received bitwise and on the recipient's GPU.
The NCCL checks (a 1-rank group aborted while blocked, then built again) are GPU tests
(tests/test_gpu.py), run by gpu_check.sh before this script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
FINAL = re.compile(r"final step=(\d+) loss=\S+ test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")
MEMORY_LINE = re.compile(r"memory (ready|not freed)[^(]*\(waited ([0-9.]+) s, (\w+)")
DIGITS_STEPS = 40
CHARLM_STEPS = 16
JOB_TIMEOUT_S = float(os.environ.get("FTRUN_GPU_CHECK_JOB_TIMEOUT_S", "120"))  # one job; more for a rehearsal on a busy CPU
SESSIONS: set[int] = set()  # jobs started in their own session: ended with this script (see main)


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, REHEARSED
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


class Failed(Exception):
    """A check's expectation did not hold (its message is the FAIL line's detail)."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)


# ----------------------------------------------------------------------------- running jobs
class Jobs:
    """Runs ftrun and torchrun jobs of the examples on ``device`` under ``work``."""

    def __init__(self, device: str, work: Path) -> None:
        self.device = device
        self.work = work
        self.count = 0

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
        out.update({"PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        out.update(extra or {})
        return out

    def log_dir(self, tag: str) -> Path:
        self.count += 1
        path = self.work / f"{self.count:02d}_{tag}"
        path.mkdir(parents=True)
        return path

    def ftrun_cmd(self, log_dir: Path, script: str, args: list[str], launcher: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        return [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain",
                "--log_dir", str(log_dir), "--tail_worker_log", "0", "--max_restarts", "4", *launcher,
                str(ROOT / "examples" / script), *args, "--device", self.device]

    def ftrun(self, tag: str, script: str, args: list[str], fault: str | None = None,
              launcher: list[str] = ()) -> tuple[str, list[dict], Path]:  # type: ignore[assignment]
        log_dir = self.log_dir(tag)
        text = run_job(self.ftrun_cmd(log_dir, script, args, launcher),
                       self.env({"FTRUN_FAULT": fault} if fault else None), log_dir, f"{tag} (ftrun)")
        return digest_of(text, tag), events(log_dir), log_dir

    def torchrun(self, tag: str, script: str, args: list[str]) -> str:
        log_dir = self.log_dir(tag)
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc_per_node", "4", str(ROOT / "examples" / script),
               *args, "--device", self.device]
        if not torchrun.exists():
            cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
        return digest_of(run_job(cmd, self.env(), log_dir, f"{tag} (torchrun)"), tag)

    def ftrun_outside_kill(self, tag: str, script: str, args: list[str], rank: int, launcher: list[str] = (),  # type: ignore[assignment]
                           wait_glob: str | None = None, step_pause_s: float = 0.2) -> tuple[str, list[dict], Path, dict[str, Any]]:
        """The job slowed by ``--step_pause`` (``step_pause_s`` a step) while a file exists; ``rank``
        SIGKILLed from outside once every rank trains (and a file matching ``wait_glob`` is in the log
        folder: a hot spare waiting for its rank); the pause lifted once the recovery finished."""
        log_dir = self.log_dir(tag)
        pause = log_dir / "pause"
        pause.touch()
        cmd = self.ftrun_cmd(log_dir, script, [*args, "--step_pause", str(step_pause_s), "--pause_while", str(pause)], launcher)
        with open(log_dir / "stdout.txt", "w") as out:
            proc = subprocess.Popen(cmd, env=self.env(), cwd=log_dir, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            SESSIONS.add(proc.pid)
            figures: dict[str, Any] = {}
            try:
                pids = wait_for(lambda: started_pids(events(log_dir)) if len(started_pids(events(log_dir))) == 4 else None,
                                60, f"{tag}: 4 ranks started")
                wait_for(lambda: (log_dir / "stdout.txt").read_text().count("step ") >= 1 or None, 60,
                         f"{tag}: training under way")
                if wait_glob is not None:
                    wait_for(lambda: any(log_dir.glob(wait_glob)) or None, 90, f"{tag}: {wait_glob}")
                time.sleep(1.0)
                figures["survivor_gpu_bytes_before"] = gpu_bytes_of([p[0] for r, p in pids.items() if r != rank])
                killed_at = time.time()
                os.kill(pids[rank][0], signal.SIGKILL)
                wait_for(lambda: any(e["kind"] == "recovery_finished" for e in events(log_dir)) or None, 90,
                         f"{tag}: recovery finished")
                figures["kill_to_recovered_s"] = round(next(e["time"] for e in events(log_dir)
                                                            if e["kind"] == "recovery_finished") - killed_at, 3)
                figures["survivor_gpu_bytes_after"] = gpu_bytes_of([p[0] for r, p in pids.items() if r != rank])
                pause.unlink()
                proc.wait(timeout=JOB_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                SESSIONS.discard(proc.pid)
        text = (log_dir / "stdout.txt").read_text()
        expect(proc.returncode == 0, f"{tag}: ftrun exited {proc.returncode}: {tail(text)}")
        return digest_of(text, tag), events(log_dir), log_dir, figures


def run_job(cmd: list[str], env: dict[str, str], cwd: Path, tag: str) -> str:
    """Run a job in its own session (torchrun's workers outlive a killed torchrun: the whole
    session is ended on a timeout); its output, also written to ``cwd/stdout.txt``."""
    with open(cwd / "stdout.txt", "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        SESSIONS.add(proc.pid)
        try:
            proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Failed(f"{tag}: no end after {JOB_TIMEOUT_S:.0f} s: {tail((cwd / 'stdout.txt').read_text())}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
            except ProcessLookupError:
                pass
            proc.wait()
            SESSIONS.discard(proc.pid)
    text = (cwd / "stdout.txt").read_text()
    expect(proc.returncode == 0, f"{tag}: exited {proc.returncode}: {tail(text)}")
    return text


def tail(text: str, n: int = 600) -> str:
    return " | ".join(text[-n:].splitlines()[-6:])


def digest_of(stdout: str, tag: str) -> str:
    match = FINAL.search(stdout)
    expect(match is not None, f"{tag}: no final line: {tail(stdout)}")
    return match.group(3)  # type: ignore[union-attr]


def events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def started_pids(evs: list[dict]) -> dict[int, list[int]]:
    pids: dict[int, list[int]] = {}
    for ev in evs:
        if ev["kind"] == "rank_started":
            pids.setdefault(ev["rank"], []).append(ev["pid"])
    return pids


def wait_for(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise Failed(f"timed out after {timeout:.0f} s waiting for: {what}")


def gpu_bytes_of(pids: list[int]) -> dict[str, int] | None:
    """GPU memory each process holds (NVML's compute processes), or None where NVML cannot tell."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        held: dict[str, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if p.pid in pids:
                    held[str(p.pid)] = held.get(str(p.pid), 0) + int(p.usedGpuMemory or 0)
        return held or None
    except Exception:
        return None


def memory_wait(log_dir: Path, rank: int) -> dict[str, Any] | None:
    """The respawned rank's wait for its GPU's memory, as its log says (ftrun.rank.cuda.MemoryWait.line)."""
    path = log_dir / f"worker_{rank}.log"
    match = MEMORY_LINE.search(path.read_text(errors="replace")) if path.exists() else None
    return None if match is None else {"ready": match.group(1) == "ready", "waited_s": float(match.group(2)),
                                       "how": match.group(3)}


def recovery_figures(evs: list[dict]) -> dict[str, Any]:
    done = [e for e in evs if e["kind"] == "recovery_finished"]
    keys = ("total_seconds", "detection_seconds", "respawn_seconds", "transfer_seconds", "rebuild_seconds")
    detail = done[-1].get("detail") or {} if done else {}
    return {k: detail[k] for k in keys if k in detail}


def survivors_kept(evs: list[dict], replaced: set[int]) -> bool:
    pids = started_pids(evs)
    return all(len(p) == 1 for r, p in pids.items() if r not in replaced) and all(len(pids.get(r, [])) >= 2 for r in replaced)


# ----------------------------------------------------------------------------- the checks
class Checks:
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.digits_reference: str | None = None
        self.digits_args = ["--steps", str(DIGITS_STEPS), "--log_every", "5"]
        self.charlm_args = ["--size", "small", "--steps", str(CHARLM_STEPS), "--log_every", "4", "--eval_windows", "16"]

    def reference(self) -> str:
        if self.digits_reference is None:
            self.digits_reference, _, _ = self.jobs.ftrun("digits_reference", "train_digits.py", self.digits_args)
        return self.digits_reference

    def digits_fault_free(self) -> dict[str, Any]:
        mine = self.reference()
        twin = self.jobs.torchrun("digits_torchrun", "train_digits_torchrun.py", self.digits_args)
        expect(mine == twin, f"ftrun {mine[:12]} != torchrun DDP {twin[:12]}")
        return {"digest": mine}

    def digits_outside_sigkill(self) -> dict[str, Any]:
        digest, evs, log_dir, figures = self.jobs.ftrun_outside_kill("digits_sigkill", "train_digits.py", self.digits_args, 2)
        expect(digest == self.reference(), f"digest {digest[:12]} != fault-free {self.reference()[:12]}")
        expect(survivors_kept(evs, {2}), f"survivors' processes: {started_pids(evs)}")
        before, after = figures.get("survivor_gpu_bytes_before"), figures.get("survivor_gpu_bytes_after")
        if before is not None and after is not None:
            expect(set(before) == set(after), f"survivors' GPU memory: before {before}, after {after}")
        figures["memory_wait"] = memory_wait(log_dir, 2)
        if self.jobs.device == "cuda":
            expect(figures["memory_wait"] is not None, "the respawned rank's log has no GPU-memory line")
        return {**figures, **recovery_figures(evs)}

    def digits_kill_at_allreduce(self) -> dict[str, Any]:
        digest, evs, log_dir = self.jobs.ftrun("digits_kill_allreduce", "train_digits.py", self.digits_args,
                                               fault="rank=1,step=8,point=allreduce,kind=kill")
        expect(digest == self.reference(), f"digest {digest[:12]} != fault-free {self.reference()[:12]}")
        expect(survivors_kept(evs, {1}), f"survivors' processes: {started_pids(evs)}")
        return {"memory_wait": memory_wait(log_dir, 1), **recovery_figures(evs)}

    def digits_recoverable(self) -> dict[str, Any]:
        digest, evs, _ = self.jobs.ftrun("digits_recoverable", "train_digits.py", self.digits_args,
                                         fault="rank=3,step=6,point=optimizer,kind=recoverable")
        expect(digest == self.reference(), f"digest {digest[:12]} != fault-free {self.reference()[:12]}")
        expect(survivors_kept(evs, set()), f"a rank was respawned: {started_pids(evs)}")
        return {}

    def charlm_small(self) -> dict[str, Any]:
        mine, _, _ = self.jobs.ftrun("charlm_reference", "train_charlm.py", self.charlm_args)
        twin = self.jobs.torchrun("charlm_torchrun", "train_charlm_torchrun.py", self.charlm_args)
        expect(mine == twin, f"ftrun {mine[:12]} != torchrun DDP {twin[:12]}")
        faulted, evs, _ = self.jobs.ftrun("charlm_kill_allreduce", "train_charlm.py", self.charlm_args,
                                          fault="rank=2,step=5,point=allreduce,kind=kill")
        expect(faulted == mine, f"with a kill at the all-reduce {faulted[:12]} != fault-free {mine[:12]}")
        expect(survivors_kept(evs, {2}), f"survivors' processes: {started_pids(evs)}")
        return {"digest": mine, **recovery_figures(evs)}

    def hot_spare_promotion(self) -> dict[str, Any]:
        digest, evs, log_dir, figures = self.jobs.ftrun_outside_kill(
            "digits_hot_spare", "train_digits.py", self.digits_args, 0, launcher=["--hot_spares", "1"],
            # The spare waits for its rank (past the script's set-up: imports and a CUDA context, over 9 s
            # on a fresh lent machine, longer than the 40 steps at 0.2 s); 1 s a step until the kill.
            wait_glob=".hot_spare_*.ready", step_pause_s=1.0)
        expect(digest == self.reference(), f"digest {digest[:12]} != fault-free {self.reference()[:12]}")
        hot = [e for e in evs if e["kind"] == "rank_started" and e.get("rank") == 0 and (e.get("detail") or {}).get("hot_spare")]
        expect(bool(hot), "no hot spare took rank 0: " + "; ".join(e.get("message", "") for e in evs
                                                                  if e["kind"] == "rank_started" and e.get("rank") == 0))
        expect(survivors_kept(evs, {0}), f"survivors' processes: {started_pids(evs)}")
        return {**figures, "memory_wait": memory_wait(log_dir, 0), **recovery_figures(evs)}

    def state_transfer_snapshot(self) -> dict[str, Any]:
        text = run_job([sys.executable, str(Path(__file__).resolve()), "--transfer", self.jobs.device],
                       self.jobs.env(), self.jobs.log_dir("transfer"), "transfer")
        lines = [line for line in text.splitlines() if line.startswith("{\"transfer_bytes\"")]
        expect(bool(lines), f"transfer: no figures printed: {tail(text)}")
        figures = json.loads(lines[-1])
        expect(figures.pop("bitwise"), "the received state differs from the sent")
        expect(figures.pop("on_device"), "the received state is not on the recipient's device")
        expect(figures["snapshot_pinned"] is not False, "a snapshot of the GPU's tensors is not in pinned memory")
        return figures


# ----------------------------------------------------------------------------- transfer and snapshot
def charlm_medium_state(device: str) -> dict[str, Any]:
    """charlm-medium's parameters and AdamW state after one step, on ``device``."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import charlm_common as cc  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = cc.build_model("medium", 128).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 129), device=device)
    cc.loss_of(model, x[:, :-1], x[:, 1:]).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def state_digest(state: Any) -> str:
    from ftrun.common.codec import flatten

    _skeleton, tensors = flatten(state)
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _transfer_rank(rank: int, device: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ftrun.rank.transfer import recv_state, send_state

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    state = charlm_medium_state(device)
    if rank == 1:  # the recipient's own copy: zeroed, so only the transfer can make it equal
        for t in state["model"].values():
            t.zero_()
    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        nbytes = send_state(state, 1)
    else:
        received, nbytes = recv_state(0, state)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    dist.barrier()
    if rank == 1:
        sent = charlm_medium_state(device)
        tensors = [t for t in received["model"].values()]
        on_device = all(t.device.type == device for t in tensors)
        Path(out).write_text(json.dumps({"transfer_bytes": nbytes, "transfer_s": round(seconds, 4),
                                         "transfer_gb_s": round(nbytes / seconds / 1e9, 3),
                                         "bitwise": state_digest(received) == state_digest(sent), "on_device": on_device}))
    dist.destroy_process_group()


def transfer_and_snapshot(device: str) -> dict[str, Any]:
    """In this process: the snapshot's cost of charlm-medium state on ``device``; then two processes
    (gloo, one GPU) transfer it. Prints one JSON line."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from ftrun.common.checkpoint import snapshot
    from ftrun.common.codec import flatten

    state = charlm_medium_state(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    timings, copy = [], None
    for _ in range(3):
        started = time.perf_counter()
        copy = snapshot(state, reuse=copy)
        timings.append(round(time.perf_counter() - started, 4))
    nbytes = sum(t.numel() * t.element_size() for t in flatten(state)[1])
    # The copies of the GPU's tensors are pinned; a CPU tensor's (AdamW's step counts) need not be.
    pinned = all(c.is_pinned() for t, c in zip(flatten(state)[1], flatten(copy)[1]) if t.is_cuda and c.numel()) if device == "cuda" else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "transfer.json")
        mp.start_processes(_transfer_rank, args=(device, port, out), nprocs=2, start_method="spawn")
        figures = json.loads(Path(out).read_text())
    figures.update({"state_bytes": nbytes, "snapshot_s": timings, "snapshot_gb_s_reused": round(nbytes / min(timings[1:]) / 1e9, 3),
                    "snapshot_pinned": pinned, "snapshot_equal": state_digest(copy) == state_digest(state)})
    if not figures["snapshot_equal"]:
        figures["bitwise"] = False
    return figures


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (the checks) or cpu (a rehearsal of their logic; checks nothing about CUDA)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="where the JSON and logs go")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--transfer", default=None, help=argparse.SUPPRESS)  # the transfer check's own process
    args = parser.parse_args(argv)
    if args.transfer:
        print(json.dumps(transfer_and_snapshot(args.transfer)), flush=True)
        return 0
    import torch

    def stopped(signum: int, _frame: Any) -> None:  # `timeout` ends this script: end the jobs in their own session too
        for pid in list(SESSIONS):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here: nothing checked (use --device cpu to rehearse the checks' logic)")
        return 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ftrun_gpu_check_"))
    checks = Checks(Jobs(args.device, work))
    names = ["digits_fault_free", "digits_outside_sigkill", "digits_kill_at_allreduce", "digits_recoverable",
             "charlm_small", "hot_spare_promotion", "state_transfer_snapshot"]
    if args.only:
        unknown = set(args.only.split(",")) - set(names)
        if unknown:
            print(f"gpu_check: unknown check(s) {', '.join(sorted(unknown))}; the checks are {', '.join(names)}")
            return 2
        names = [n for n in names if n in args.only.split(",")]
    passed = "PASS" if args.device == "cuda" else "REHEARSED"
    results: list[Result] = []
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None

    def write() -> None:  # after every check: a run stopped at its limit still leaves what it found
        doc = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "work_dir": str(work),
               "checks": [asdict(r) for r in results], "not_run": names[len(results):]}
        (out / "gpu_check_jobs.json").write_text(json.dumps(doc, indent=1))

    for name in names:
        started = time.monotonic()
        try:
            result = Result(name, passed, figures=getattr(checks, name)())
        except Failed as err:
            result = Result(name, "FAIL", detail=str(err))
        except Exception as err:  # noqa: BLE001  a broken check is a failed one, with its reason
            result = Result(name, "FAIL", detail=f"{type(err).__name__}: {err}")
        result.seconds = round(time.monotonic() - started, 1)
        results.append(result)
        print(f"{result.status:9} {name} ({result.seconds:.1f} s) {json.dumps(result.figures) if result.figures else ''}"
              f"{result.detail}", flush=True)
        write()
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        print(f"gpu_check: FAIL: {', '.join(failed)} (logs under {work})")
        return 1
    if args.device != "cuda":
        print(f"gpu_check: {len(results)} check(s) rehearsed on the CPU; nothing was checked on a GPU")
        return 3
    print(f"gpu_check: PASS: {len(results)} check(s) on {gpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

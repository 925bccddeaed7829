"""Helpers shared by the framework integrations' tests: the ranks' environment, the job's events,
the in-place recovery check, torchrun's exit, and the count of a port's changed lines."""

from __future__ import annotations

import ast
import difflib
import json
import os
import subprocess
from pathlib import Path
from typing import Pattern

#: What a rank's gloo teardown at interpreter exit prints when it aborts (SIGABRT), after the
#: loop's last collective and rank 0's final line (tests/test_accelerate.py).
TEARDOWN_ABORT = "terminate called without an active exception"


def env() -> dict[str, str]:
    """This process's environment without ftrun's and torchrun's variables, one thread a rank."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return out


def events(log_dir: Path) -> list[dict]:
    """The job's events (``events.jsonl``), or [] when it wrote none."""
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def hf_env() -> dict[str, str]:
    """:func:`env` for Hugging Face's libraries: offline, no tokenizer threads, no advisory warnings."""
    out = env()
    out.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    out.pop("PYTHONWARNINGS")
    return out


def assert_recovered_in_place(evs: list[dict], faulted: int, world: int, allow_behind: bool = False) -> None:
    """Only ``faulted`` was restarted (the survivors' PIDs never changed), once, by a rank-level
    recovery (no whole-job restart), and no exactly-once check reported a divergence.

    ``allow_behind``: one order is allowed besides (CI saw it on a loaded machine): a survivor
    still in the previous step's all-reduce when the victim died, which failed for it while its
    replicas' completed (a ring's ranks finish at different moments). Its replicas committed that
    step, so the integration ends it on purpose (``retry_step``: a Trainer cannot run the step's
    logging and callbacks twice) and ARF replaces it, once."""
    pids: dict[int, list[int]] = {}
    for ev in evs:
        if ev["kind"] == "rank_started":
            pids.setdefault(ev["rank"], []).append(ev["pid"])
    assert sorted(pids) == list(range(world))
    failed = {e["rank"]: e for e in evs if e["kind"] == "rank_failed"}
    behind = {rank for rank, ev in failed.items() if allow_behind and rank != faulted
              and any("which its replicas committed; it resumes at step" in line for line in ev["detail"].get("log_tail", []))}
    for rank, started in pids.items():
        assert len(started) == (2 if rank == faulted or rank in behind else 1), f"rank {rank}: {started}"
    assert sorted(failed) == sorted({faulted} | behind)
    assert not [e for e in evs if e["kind"] == "job_restarting"], "fell back to a whole-job restart"
    assert [e for e in evs if e["kind"] == "recovery_finished"], "no recovery finished"
    assert not [e.get("message") for e in evs if e["kind"] == "divergence"]


def assert_torchrun_ok(proc: subprocess.CompletedProcess, final: Pattern[str]) -> None:
    """torchrun succeeded, or only a rank's exit aborted after the final line (:data:`TEARDOWN_ABORT`)."""
    teardown = final.search(proc.stdout) and TEARDOWN_ABORT in proc.stderr and "Traceback" not in proc.stderr.split(
        TEARDOWN_ABORT)[0]
    assert proc.returncode == 0 or teardown, proc.stdout[-3000:] + proc.stderr[-3000:]


def port_diff(script: Path, plain: str = "main", port: str = "main_ftrun") -> list[str]:
    """The lines by which function ``port`` differs from ``plain`` in ``script`` (a unified diff
    without context: ``-`` removed, ``+`` added)."""
    source = script.read_text()
    lines = source.splitlines()
    bodies = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in (plain, port):
            bodies[node.name] = lines[node.body[0].lineno - 1:node.end_lineno]
    return [line for line in difflib.unified_diff(bodies[plain], bodies[port], lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]

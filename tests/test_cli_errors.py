"""The real CLI on bad input: exit 2, one ``ftrun: error: ...`` line on stderr, no traceback, no process left.

Each case runs ``python -m ftrun ...`` in a fresh directory with a uniquely named script that would
leave a marker file if it ever ran; none of these inputs may get as far as spawning a rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import pytest

from conftest import TAG_VAR, clean_env, tagged


@dataclass
class Case:
    """args/env may use {script}, {tmp} and {port}; setup(tmp) prepares files."""

    args: list[str]
    hint: str
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None


def _write(name: str, text: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_text(text)

    return setup


def _mkdir(name: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / name).mkdir()


def _bad_package(tmp: Path) -> None:
    pkg = tmp / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('broken package')\n")
    (pkg / "train.py").write_text("print('never')\n")


CASES = {
    "no-script": Case([], "no script given"),
    "missing-script": Case(["{tmp}/missing_{uid}.py"], "not found"),
    "worker-num-0": Case(["--worker_num", "0", "{script}"], "--worker_num must be at least 1"),
    "local-gt-world": Case(["--local_worker_num", "4", "--worker_num", "2", "{script}"], "larger than --worker_num"),
    "nproc-per-node-gt-world": Case(["--nproc-per-node", "4", "--worker-num", "2", "{script}"], "larger than --worker_num"),
    "not-a-multiple": Case(["--worker_num", "5", "--local_worker_num", "2", "{script}"], "not a multiple"),
    "node-rank-out-of-range": Case(["--node_rank", "1", "{script}"], "--node_rank 1"),
    "port-out-of-range": Case(["--master_port", "70000", "{script}"], "not a TCP port"),
    "port-0-two-nodes": Case(["--worker_num", "4", "--local_worker_num", "2", "--master_port", "0", "{script}"],
                             "one node only"),
    "port-in-use-loopback": Case(["--master_port", "{port}", "--log_dir", "{tmp}/logs", "{script}"], "already in use"),
    "port-in-use-any": Case(["--master_port", "{port_any}", "--log_dir", "{tmp}/logs", "{script}"], "already in use"),
    "worker-num-abc": Case(["--worker_num", "abc", "{script}"], "must be an integer"),
    "max-restarts-negative": Case(["--max_restarts", "-1", "{script}"], "--max_restarts"),
    "tail-worker-log-out-of-range": Case(["--worker_num", "2", "--tail_worker_log", "5", "{script}"], "--tail_worker_log"),
    "env-worker-num-abc": Case(["{script}"], "FTRUN_WORKER_NUM", env={"FTRUN_WORKER_NUM": "abc"}),
    "ftrun-tft-malformed": Case(["{script}"], "FTRUN_TFT", env={"FTRUN_TFT": "{ARF:2}"}),
    "ftrun-tft-unbalanced": Case(["{script}"], "unbalanced", env={"FTRUN_TFT": "{ARF:1"}),
    "ms-enable-tft-malformed": Case(["{script}"], "MS_ENABLE_TFT", env={"MS_ENABLE_TFT": "{ARF:1,BOGUS:1}"}),
    "cli-tft-unknown-switch": Case(["--tft", "{FOO:1}", "{script}"], "unknown switch"),
    "config-missing": Case(["--config", "{tmp}/nope_{uid}.toml", "{script}"], "cannot read config file"),
    "config-is-directory": Case(["--config", "{tmp}/cfgdir", "{script}"], "cannot read config file",
                                setup=_mkdir("cfgdir")),
    "config-invalid-toml": Case(["--config", "{tmp}/bad.toml", "{script}"], "not valid TOML",
                                setup=_write("bad.toml", "worker_num = = 2\n[unclosed\n")),
    "config-unknown-key": Case(["--config", "{tmp}/cfg.toml", "{script}"], "unknown key 'num_workers'",
                               setup=_write("cfg.toml", "num_workers = 2\n")),
    "config-bad-value": Case(["--config", "{tmp}/cfg.toml", "{script}"], "worker_num",
                             setup=_write("cfg.toml", "[ftrun]\nworker_num = 'two'\n")),
    "pyproject-unknown-key": Case(["{script}"], "unknown key 'bogus'",
                                  setup=_write("pyproject.toml", "[tool.ftrun]\nbogus = 1\n")),
    "pyproject-invalid": Case(["{script}"], "not valid TOML", setup=_write("pyproject.toml", "[tool.ftrun\n")),
    "missing-module": Case(["-m", "no_such_module_{uid}"], "not found"),
    "missing-program": Case(["--no_python", "no-such-program-{uid}"], "not found"),
    "module-and-no-python": Case(["-m", "--no_python", "json"], "cannot be used together"),
    "nproc-disagrees": Case(["--nproc_per_node", "2", "--local_worker_num", "3", "{script}"], "disagree"),
    "log-dir-not-writable": Case(["--master_port", "0", "--log_dir", "{tmp}/afile/logs", "{script}"], "--log_dir",
                                 setup=_write("afile", "x")),
    "unknown-option": Case(["--bogus", "{script}"], "--bogus"),
    "option-missing-value": Case(["--worker_num"], "--worker_num"),
    "module-parent-raises": Case(["-m", "brokenpkg.train"], "brokenpkg", setup=_bad_package),
}


@pytest.fixture
def listening_ports():
    """Two ports with a listening socket: one on 127.0.0.1, one on all addresses."""
    socks = []
    ports = []
    for addr in ("127.0.0.1", "0.0.0.0"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((addr, 0))
        sock.listen(1)
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    yield ports
    for sock in socks:
        sock.close()


def _fill(text: str, values: dict) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def _pids_of_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _procs_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and any(text in part for part in (proc.info["cmdline"] or ())):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cli_error(case: Case, tmp_path: Path, listening_ports):
    uid = uuid.uuid4().hex
    marker = tmp_path / f"ran_{uid}"
    script = tmp_path / f"train_{uid}.py"
    script.write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "time.sleep(120)\n"
    )
    if case.setup is not None:
        case.setup(tmp_path)
    fmt = {"script": str(script), "tmp": str(tmp_path), "uid": uid,
           "port": listening_ports[0], "port_any": listening_ports[1]}
    args = [_fill(a, fmt) for a in case.args]
    tag = uuid.uuid4().hex
    env = clean_env({k: _fill(v, fmt) for k, v in case.env.items()})
    env[TAG_VAR] = tag

    before = _pids_of_children()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ftrun", *args],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=45,
        )
    finally:
        leftovers = tagged(tag) + _procs_mentioning(uid)
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.Error:
                pass

    detail = f"args={args}\nrc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, detail
    assert result.returncode == 2, detail
    lines = result.stderr.splitlines()
    assert len(lines) == 1, detail
    assert lines[0].startswith("ftrun: error: ") and lines[0].strip() != "ftrun: error:", detail
    assert case.hint in lines[0], detail
    assert not leftovers, f"processes left behind: {leftovers}\n{detail}"
    assert _pids_of_children() <= before, detail
    assert not marker.exists(), "the script ran although the input was invalid"
    assert not (tmp_path / "logs" / "events.jsonl").exists(), "a supervisor started"

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
    """args/env/hint may use {script}, {tmp}, {uid} and {port}; setup(tmp) prepares files."""

    args: list[str]
    hint: str
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None


def _write(name: str, text: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_text(text)

    return setup


def _write_bytes(name: str, data: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_bytes(data)

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
    "port-out-of-range": Case(["--master_port", "70000", "{script}"], "--master_port must be at least 0 and at most 65535"),
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
    # numbers out of their range (accepted before, or overflowing deep inside torch)
    "monitor-interval-inf": Case(["--monitor_interval", "inf", "{script}"], "--monitor_interval must be at least 0.001"),
    "monitor-interval-nan": Case(["--monitor_interval", "nan", "{script}"], "got nan"),
    "heartbeat-interval-nan": Case(["--heartbeat_interval", "nan", "{script}"], "--heartbeat_interval must be"),
    "cluster-time-out-huge": Case(["--cluster_time_out", "1e15", "{script}"], "at most 604800 s, got 1e15"),
    "pg-timeout-huge": Case(["--pg_timeout", "1e15", "{script}"], "--pg_timeout must be more than 0 and at most 604800"),
    "env-pg-timeout-inf": Case(["{script}"], "FTRUN_PG_TIMEOUT must be", env={"FTRUN_PG_TIMEOUT": "inf"}),
    "env-heartbeat-nan": Case(["{script}"], "FTRUN_HEARTBEAT_INTERVAL must be", env={"FTRUN_HEARTBEAT_INTERVAL": "nan"}),
    "warm-spares-huge": Case(["--warm_spares", "100000", "{script}"], "--warm_spares must be at least 0 and at most 64"),
    "config-pg-timeout-huge": Case(["--config", "{tmp}/cfg.toml", "{script}"], "key pg_timeout in",
                                   setup=_write("cfg.toml", "pg_timeout = 1e15\n")),
    # TOML values of the wrong type, and files that are not TOML text
    "config-list-for-string": Case(["--config", "{tmp}/cfg.toml", "{script}"],
                                   "key master_addr in {tmp}/cfg.toml is an array ([1, 2]); master_addr takes a string",
                                   setup=_write("cfg.toml", "master_addr = [1, 2]\n")),
    "config-table-for-string": Case(["--config", "{tmp}/cfg.toml", "{script}"], "log_dir takes a string",
                                    setup=_write("cfg.toml", "[ftrun]\nlog_dir = {a = 1}\n")),
    "config-string-for-int": Case(["--config", "{tmp}/cfg.toml", "{script}"], "worker_num takes an integer",
                                  setup=_write("cfg.toml", "worker_num = '2'\n")),
    "config-tft-bad-switch-value": Case(["--config", "{tmp}/cfg.toml", "{script}"], "switch ARF",
                                        setup=_write("cfg.toml", "tft = {ARF = 'no'}\n")),
    "config-key-twice": Case(["--config", "{tmp}/cfg.toml", "{script}"], "sets worker_num twice",
                             setup=_write("cfg.toml", "worker-num = 1\nworker_num = 2\n")),
    "config-nul-in-string": Case(["--config", "{tmp}/cfg.toml", "{script}"], "NUL character",
                                 setup=_write("cfg.toml", 'log_dir = "a\\u0000b"\n')),
    "config-binary": Case(["--config", "{tmp}/bin.toml", "{script}"], "is not UTF-8 text",
                          setup=_write_bytes("bin.toml", b"\x89PNG\r\n\x1a\n\x00\xff\xfe")),
    "config-too-large": Case(["--config", "{tmp}/big.toml", "{script}"], "larger than 1048576 bytes",
                             setup=_write("big.toml", "# filler\n" * 150_000)),
    "pyproject-binary": Case(["{script}"], "is not UTF-8 text", setup=_write_bytes("pyproject.toml", b"\xff\xfe\x00")),
    "pyproject-tool-not-a-table": Case(["{script}"], "tool in", setup=_write("pyproject.toml", "tool = 3\n")),
    "check-unknown-scenario": Case(["check", "--scenarios", "allreduce,midway", "{script}"], "unknown scenario midway"),
    # FTRUN_FAULT is checked before any rank starts (each rank would fail to import it)
    "fault-rank-not-integer": Case(["{script}"], "rank='x' is not an integer", env={"FTRUN_FAULT": "rank=x"}),
    "fault-unknown-kind": Case(["{script}"], "unknown kind 'boom'", env={"FTRUN_FAULT": "rank=0,kind=boom"}),
    "fault-rank-outside-job": Case(["--worker_num", "2", "{script}"], "names rank 5",
                                   env={"FTRUN_FAULT": "rank=5,step=3"}),
    # addresses
    "master-addr-bad-ipv4": Case(["--master_addr", "999.1.1.1", "{script}"], "not a valid IPv4 address"),
    "master-addr-unresolvable": Case(["--master_addr", "no-such-host-{uid}.invalid", "{script}"], "cannot resolve"),
    "env-master-addr-bad": Case(["{script}"], "FTRUN_MASTER_ADDR", env={"FTRUN_MASTER_ADDR": "1.2.3.4.5"}),
    "local-addr-bad": Case(["--local-addr", "fe80::zz", "{script}"], "--local_addr"),
    # the checkpoint directory (TTP is on by default)
    "checkpoint-dir-is-a-file": Case(["--checkpoint_dir", "{tmp}/afile", "{script}"], "is a file",
                                     setup=_write("afile", "x")),
    "checkpoint-dir-under-a-file": Case(["--checkpoint_dir", "{tmp}/afile/ckpt", "{script}"],
                                        "cannot create --checkpoint_dir", setup=_write("afile", "x")),
    "checkpoint-dir-read-only": Case(["--checkpoint_dir", "/proc/ftrun-{uid}", "{script}"], "--checkpoint_dir"),
    # torchrun's command line
    "nnodes-not-a-count": Case(["--nnodes", "two", "{script}"], "--nnodes 'two' is not a node count"),
    "nnodes-min-above-max": Case(["--nnodes", "4:2", "{script}"], "MIN 4 is larger than MAX 2"),
    "nnodes-disagrees-with-worker-num": Case(["--nnodes", "2", "--nproc-per-node", "2", "--worker_num", "3", "{script}"],
                                             "disagrees"),
    "multi-node-without-token": Case(["--nnodes", "2", "--nproc-per-node", "1", "{script}"], "needs a shared secret"),
    "multi-node-short-token": Case(["--nnodes", "2", "{script}"], "at least 16", env={"FTRUN_TOKEN": "short"}),
    "token-file-missing": Case(["--token_file", "{tmp}/nope_{uid}", "{script}"], "cannot read --token_file"),
    "token-file-fifo": Case(["--token_file", "{tmp}/tokfifo", "{script}"], "--token_file {tmp}/tokfifo is a FIFO",
                            setup=lambda tmp: os.mkfifo(tmp / "tokfifo")),
    "token-file-directory": Case(["--token_file", "{tmp}", "{script}"], "is a directory"),
    "token-twice": Case(["--token-file", "{tmp}/tok", "{script}"], "both set", env={"FTRUN_TOKEN": "x" * 32},
                        setup=_write("tok", "y" * 32)),
    "standalone-with-endpoint": Case(["--standalone", "--rdzv-endpoint", "node0:29400", "{script}"], "drop --rdzv-endpoint"),
    "standalone-multi-node": Case(["--standalone", "--nnodes", "2", "{script}"], "--standalone runs a single-node job"),
    "standalone-with-master-addr": Case(["--standalone", "--master-addr", "10.1.2.3", "{script}"], "drop --master_addr"),
    "rdzv-backend-etcd": Case(["--rdzv-backend", "etcd", "{script}"], "--rdzv-backend 'etcd' is not supported"),
    "rdzv-endpoint-bad-port": Case(["--rdzv-endpoint", "node0:99999", "{script}"], "is not a TCP port"),
    "rdzv-endpoint-bad-host": Case(["--rdzv_endpoint", "999.0.0.1:29400", "{script}"], "--rdzv-endpoint '999.0.0.1'"),
    "rdzv-conf-unknown-key": Case(["--rdzv-conf", "foo=1", "{script}"], "unknown key 'foo'"),
    "rdzv-conf-not-key-value": Case(["--rdzv-conf", "join_timeout", "{script}"], "is not KEY=VALUE"),
    "slurm-node-id-out-of-range": Case(["{script}"], "SLURM_NODEID (Slurm environment) 7 is outside 0..1",
                                       env={"FTRUN_TOKEN": "x" * 32, "SLURM_NNODES": "2", "SLURM_NODEID": "7",
                                            "SLURM_JOB_NODELIST": "localhost"}),
    "slurm-bad-nodelist": Case(["{script}"], "SLURM_JOB_NODELIST=node[01- (Slurm environment) 'node[01-': '[' without ']'",
                               env={"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[01-"}),
    "slurm-tasks-per-node": Case(["{script}"], "srun --ntasks-per-node=1",
                                 env={"FTRUN_TOKEN": "x" * 32, "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                                      "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NUM_TASKS": "8",
                                      "SLURM_STEP_NUM_NODES": "2"}),
    "pytorchjob-bad-node-rank": Case(["{script}"], "PET_NODE_RANK (PyTorchJob environment): 'one' is not valid for node_rank",
                                     env={"PET_NNODES": "2", "PET_NODE_RANK": "one"}),
    "tee-bad": Case(["-t", "7", "{script}"], "--tee '7'"),
    "redirects-bad-rank": Case(["--redirects", "3:3", "{script}"], "is not a local rank"),
    "local-ranks-filter-out-of-range": Case(["--nproc-per-node", "2", "--local-ranks-filter", "5", "{script}"],
                                            "--local-ranks-filter '5': '5' is not a local rank 0..1"),
    "tee-and-tail-worker-log": Case(["--tee", "3", "--tail_worker_log", "0", "{script}"], "give one of them"),
    "run-path-with-module": Case(["--run-path", "-m", "json"], "--run-path runs SCRIPT as a Python file; it cannot be combined"),
    "shutdown-timeout-disagrees": Case(["--shutdown-timeout", "5", "--grace_period", "6", "{script}"], "disagree"),
    "rdzv-id-disagrees": Case(["--rdzv-id", "a", "--run_id", "b", "{script}"], "disagree"),
    "start-method-fork": Case(["--start-method", "fork", "{script}"],
                              "--start-method fork is refused: fork would copy the launcher's state into every rank"),
    "start-method-underscore": Case(["--start_method=fork", "{script}"], "--start-method fork is refused"),
    "role-with-space": Case(["--role", "my role", "{script}"], "--role 'my role' must be 1 to 256 printable"),
    "numa-binding": Case(["--numa-binding", "node", "{script}"], "does not support torchrun's --numa-binding"),
    "logs-specs": Case(["--logs-specs", "x", "{script}"], "does not support torchrun's --logs-specs"),
    "standby-spares": Case(["--standby_spares", "cold", "{script}"], "--standby_spares 'cold' must be 'hot', 'warm' or 'none'"),
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
    assert _fill(case.hint, fmt) in lines[0], detail
    assert not leftovers, f"processes left behind: {leftovers}\n{detail}"
    assert _pids_of_children() <= before, detail
    assert not marker.exists(), "the script ran although the input was invalid"
    assert not (tmp_path / "logs" / "events.jsonl").exists(), "a supervisor started"

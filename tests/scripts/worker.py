"""A small rank script for ftrun's launcher tests (no torch: it starts fast).

Usage: ``worker.py OUT_DIR [EXTRA...] [options]``. Every rank writes ``OUT_DIR/env_<rank>_<attempt>.json``
(the environment contract, its pid, session and death signal, and whether MASTER_ADDR:MASTER_PORT
accepts a connection), prints ``hello from rank <rank> attempt <attempt>``, then does what the
options say. Files are written atomically (tmp + rename) so a test that sees one can read it whole.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "RANK_ID",
    "RANK_SIZE",
    "MS_WORKER_NUM",
    "MS_LOCAL_WORKER",
    "MS_NODE_RANK",
    "MS_SCHED_PORT",
    "DEVICE_ID",
)


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def pdeathsig() -> int:
    """The signal this process gets when its parent dies (prctl PR_GET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.c_int(-1)
        libc.prctl(2, ctypes.byref(value), 0, 0, 0)
        return value.value
    except OSError:
        return -1


def store_reachable(addr: str | None, port: str | None) -> bool:
    if not addr or not port:
        return False
    try:
        with socket.create_connection((addr, int(port)), timeout=30):
            return True
    except OSError:
        return False


def matches(rank: int, attempt: int, want_rank: int | None, want_attempt: int | None) -> bool:
    return want_rank is not None and rank == want_rank and (want_attempt is None or attempt == want_attempt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("extra", nargs="*", help="ignored (recorded in argv)")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank fails")
    parser.add_argument("--fail-attempt", type=int, default=None, help="only on this attempt (default: always)")
    parser.add_argument("--fail-mode", default="kill", help="'kill' (SIGKILL itself) or 'exit:N'")
    parser.add_argument("--marker", default=None, help="line printed just before failing")
    parser.add_argument("--wait", action="store_true", help="ranks that do not fail write ready_<rank>.json and wait")
    parser.add_argument("--ignore-term", action="store_true", help="waiting ranks ignore SIGTERM")
    parser.add_argument("--grandchild", action="store_true", help="waiting ranks start a 'sleep' child first")
    args = parser.parse_args()

    rank = int(os.environ.get("RANK", "-1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
    info = {key: os.environ.get(key) for key in ENV_KEYS}
    info.update(
        pid=os.getpid(),
        sid=os.getsid(0),
        pgid=os.getpgid(0),
        pdeathsig=pdeathsig(),
        store_reachable=store_reachable(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")),
        argv=sys.argv[1:],
    )
    write_json(os.path.join(args.out_dir, f"env_{rank}_{attempt}.json"), info)
    print(f"hello from rank {rank} attempt {attempt}", flush=True)

    if matches(rank, attempt, args.fail_rank, args.fail_attempt):
        if args.marker:
            print(args.marker, flush=True)
        if args.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(args.fail_mode.split(":", 1)[1]))

    if args.wait:
        if args.ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ready = {"pid": os.getpid(), "rank": rank, "attempt": attempt}
        if args.grandchild:
            child = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL)
            ready["grandchild"] = child.pid
        write_json(os.path.join(args.out_dir, f"ready_{rank}_{attempt}.json"), ready)
        while True:
            signal.pause()


if __name__ == "__main__":
    main()

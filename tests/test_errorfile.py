"""ftrun.node.errorfile: per-process error-file paths, and reading what torch's ``@record`` writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.node.errorfile import (
    ERROR_FILE_ENV,
    MAX_ERROR_FILE_BYTES,
    RankError,
    error_file_env,
    error_file_path,
    prepare_error_file,
    read_error_file,
)


def _torch_style(message: str, callstack: str | None = "Traceback ...\nValueError: x\n", ts: str | None = "1700000000"):
    extra: dict = {}
    if callstack is not None:
        extra["py_callstack"] = callstack
    if ts is not None:
        extra["timestamp"] = ts
    return {"message": {"message": message, "extraInfo": extra}}


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# --------------------------------------------------------------------------- paths


def test_error_file_path_is_per_process(tmp_path):
    path = error_file_path(tmp_path, rank=3, incarnation=2, attempt=1)
    assert path == tmp_path / "errors" / "attempt_1" / "rank_3.2.json"
    seen = {error_file_path(tmp_path, r, i, a) for r in range(3) for i in range(3) for a in range(3)}
    assert len(seen) == 27  # no two processes share a file
    assert error_file_path(str(tmp_path), 0, 0, 0).parent.parent.parent == tmp_path  # a str log dir works too


@pytest.mark.parametrize("rank, incarnation, attempt", [(-1, 0, 0), (0, -1, 0), (0, 0, -2), (1.0, 0, 0), (True, 0, 0)])
def test_error_file_path_refuses_bad_numbers(tmp_path, rank, incarnation, attempt):
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        error_file_path(tmp_path, rank, incarnation, attempt)


def test_prepare_error_file_creates_directory_and_removes_stale_file(tmp_path):
    path = error_file_path(tmp_path, 1, 0, 0)
    prepare_error_file(path)
    assert path.parent.is_dir() and not path.exists()
    _write(path, _torch_style("ValueError: old"))
    prepare_error_file(path)
    assert not path.exists()
    assert error_file_env(path) == {ERROR_FILE_ENV: str(path)}


# --------------------------------------------------------------------------- reading


def test_reads_torch_format(tmp_path):
    path = _write(tmp_path / "e.json", _torch_style("ValueError: bad input: 3", "Traceback (most recent call last):\n"
                                                    "  File \"x.py\", line 1\nValueError: bad input: 3\n"))
    err = read_error_file(path)
    assert err == RankError(
        exc_type="ValueError",
        message="bad input: 3",
        timestamp=1700000000.0,
        traceback="Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad input: 3\n",
    )
    assert err.summary() == "ValueError: bad input: 3"


def test_type_is_qualified_from_the_traceback(tmp_path):
    path = _write(tmp_path / "e.json", _torch_style("InjectedFault: boom", "Traceback ...\nftrun.common.faults.InjectedFault: boom\n"))
    assert read_error_file(path).exc_type == "ftrun.common.faults.InjectedFault"


def test_empty_message_and_error_code(tmp_path):
    data = _torch_style("KeyError: ")
    data["message"]["errorCode"] = 1  # added by an agent that copied a child's file
    err = read_error_file(_write(tmp_path / "e.json", data))
    assert err.exc_type == "KeyError" and err.message == "" and err.summary() == "KeyError"


def test_string_message_with_top_level_timestamp(tmp_path):
    err = read_error_file(_write(tmp_path / "e.json", {"message": "Signal 9 (SIGKILL) received", "timestamp": 12}))
    assert err == RankError(exc_type="", message="Signal 9 (SIGKILL) received", timestamp=12.0, traceback=None)
    assert err.summary() == "Signal 9 (SIGKILL) received"


@pytest.mark.parametrize("ts, expected", [("abc", None), (None, None), ("-5", None), ("nan", None), ("17.5", 17.5)])
def test_bad_or_missing_timestamp(tmp_path, ts, expected):
    err = read_error_file(_write(tmp_path / "e.json", _torch_style("OSError: x", ts=ts)))
    assert err is not None and err.timestamp == expected


def test_missing_callstack(tmp_path):
    err = read_error_file(_write(tmp_path / "e.json", {"message": {"message": "RuntimeError: x"}}))
    assert err == RankError("RuntimeError", "x", None, None)


@pytest.mark.parametrize(
    "content",
    [
        "",  # created, never written
        '{"message": {"message": "ValueError: trunc',  # the rank died while writing
        "not json at all",
        "[1, 2, 3]",
        '"a string"',
        "{}",
        '{"message": 42}',
        '{"message": {"message": null}}',
        '{"message": {"extraInfo": {"py_callstack": "x"}}}',
        "[" * 100_000,  # deeper than the JSON parser goes
    ],
    ids=["empty", "truncated", "garbage", "list", "string", "no-message", "number", "null", "no-text", "deep"],
)
def test_garbage_gives_none(tmp_path, content):
    assert read_error_file(_write(tmp_path / "e.json", content)) is None


def test_binary_missing_directory_and_huge_files_give_none(tmp_path):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00\x01garbage")
    assert read_error_file(tmp_path / "bin.json") is None
    assert read_error_file(tmp_path / "missing.json") is None
    assert read_error_file(tmp_path) is None  # a directory
    huge = _torch_style("ValueError: " + "x" * MAX_ERROR_FILE_BYTES)
    assert read_error_file(_write(tmp_path / "huge.json", huge)) is None
    assert read_error_file(Path("/dev/null")) is None


def test_unreadable_file_gives_none(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = _write(tmp_path / "e.json", _torch_style("ValueError: x"))
    path.chmod(0)
    assert read_error_file(path) is None


# --------------------------------------------------------------------------- with torch's own @record


RECORD_SCRIPT = """
import sys
from torch.distributed.elastic.multiprocessing.errors import record

class ShardMismatch(ValueError):
    pass

@record
def main():
    raise ShardMismatch("shard 3 has 7 tensors, expected 8")

main()
"""


@pytest.mark.timeout(120)
def test_reads_what_torch_record_writes(tmp_path):
    path = error_file_path(tmp_path / "logs", rank=2, incarnation=1, attempt=0)
    prepare_error_file(path)
    script = tmp_path / "train.py"
    script.write_text(RECORD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(error_file_env(path))
    before = time.time()
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "ShardMismatch" in proc.stderr  # the exception still propagates
    err = read_error_file(path)
    assert err is not None, path.read_text() if path.exists() else "no error file written"
    assert err.exc_type in ("ShardMismatch", "__main__.ShardMismatch")
    assert err.message == "shard 3 has 7 tensors, expected 8"
    assert err.summary().endswith("ShardMismatch: shard 3 has 7 tensors, expected 8")
    assert err.timestamp is not None and before - 2 <= err.timestamp <= time.time() + 2
    assert err.traceback is not None and "raise ShardMismatch" in err.traceback and "in main" in err.traceback

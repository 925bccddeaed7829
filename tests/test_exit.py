"""No process outlives the test that started it: a reference run under torchrun that times out is
killed whole (torchrun and its ranks, each in a session of its own), and the suite's leftover check
(conftest's ``pytest_runtest_teardown``) kills what a test left behind and fails it.

The Fabric port's exit under plain torchrun, run several times, is in tests/test_fabric.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from conftest import REPO, clean_env
from reference_runs import run_torchrun

pytest_plugins = ["pytester"]

#: A rank that writes its pid, then sleeps (a rank that never exits).
HANGING_RANK = """\
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(3600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.integration
def test_a_timed_out_reference_run_leaves_no_rank(tmp_path: Path) -> None:
    """Two ranks that never exit: the run times out, and torchrun and both ranks are gone when
    ``run_torchrun`` raises (before the fix, torchrun alone was killed and its ranks lived on with
    parent 1). The timeout is a generous upper bound on starting the ranks, not a measurement."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING_RANK)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_torchrun(["--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
                     env=clean_env({"OMP_NUM_THREADS": "1"}), cwd=tmp_path, timeout=25)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid_*"))]
    assert len(pids) == 2, f"the ranks did not start within the timeout:\n{timed_out.value.stderr}"
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    assert "still alive after SIGKILL" not in (timed_out.value.stderr or "")


def test_the_leftover_check_fails_a_test_that_leaves_a_process(pytester: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A test whose body starts a process and returns errors at teardown, naming the process,
    which is killed; a test that waits for its process passes."""
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_inner=textwrap.dedent(f"""
        import pathlib, subprocess, sys

        def test_leaves_one(tmp_path):
            proc = subprocess.Popen([{sys.executable!r}, "-c", "import time; time.sleep(3600)"])
            pathlib.Path({str(pytester.path)!r}, "pid").write_text(str(proc.pid))

        def test_waits_for_its_own():
            subprocess.run([{sys.executable!r}, "-c", "pass"], check=True)
    """))
    monkeypatch.setenv("PYTEST_LEFTOVER_GRACE_S", "0.5")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*1 process(es) of this test left behind (killed now)*"])
    assert _gone(int((pytester.path / "pid").read_text()))

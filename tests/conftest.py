"""Shared helpers for ftrun's tests: run the real CLI, and never leave a process behind.

Every ftrun process a test starts through the :func:`ftrun_proc` fixture carries a unique tag in its
environment (``PYTEST_FTRUN_TAG``); the supervisor and the ranks inherit it, so the fixture's
finalizer can find and SIGKILL whatever survived a failing test, even processes that were orphaned.
Nothing here waits on a clock except generous upper bounds: tests synchronise on files.

Every test is checked for processes of its own left behind: while its body runs, the environment
carries a tag of that test (``PYTEST_TEST_TAG``), so every process it starts (and every process
those start, orphans included) carries it; once the test's fixtures are torn down, a process still
carrying it is killed and the test errors, naming it (:func:`pytest_runtest_teardown`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORKER = SCRIPTS / "worker.py"
TAG_VAR = "PYTEST_FTRUN_TAG"
TEST_TAG_VAR = "PYTEST_TEST_TAG"  # the running test's tag, in the environment of what it starts
#: How long processes a test left behind may take to end on their own (a job cancelled at teardown)
#: before they count as left: waited for only when some are found.
LEFTOVER_GRACE_S = float(os.environ.get("PYTEST_LEFTOVER_GRACE_S", "15"))
#: How many times a failed multi-process test (marker ``integration``) is run again before it counts
#: as failed (pytest-rerunfailures); ``FTRUN_TEST_RERUNS=0`` turns it off when hunting a flake. Every
#: rerun is listed at the end of the run with the failure that caused it: a rerun hides nothing.
RERUNS = int(os.environ.get("FTRUN_TEST_RERUNS", "1"))


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without anything that configures ftrun or torchelastic (a cluster's environment
    included: Slurm's ``SLURM_*``, a PyTorchJob's ``PET_*``), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("FTRUN_", "TORCHELASTIC_", "SLURM_", "PET_")) or k == "MS_ENABLE_TFT" or k == TAG_VAR)
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def tagged(tag: str, var: str = TAG_VAR) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment carries ``var=tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid():
                continue
            if proc.environ().get(var) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def is_alive(proc: psutil.Process) -> bool:
    """True while ``proc`` (the very process, not a reused pid) runs and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(procs: Iterable[psutil.Process], timeout: float = 30.0) -> list[psutil.Process]:
    """Poll until every process has ended; return those still alive after ``timeout`` seconds."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def kill_all(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def kill_tree(pid: int, tag: str) -> list[psutil.Process]:
    """SIGKILL process ``pid`` (a session leader), its session's process group, every descendant
    and every process whose environment carries ``tag`` (``TAG_VAR``: torchrun starts each rank in
    a session of its own, and a rank whose torchrun died is an orphan no listing of children finds);
    returns those still alive 30 s later."""
    procs: list[psutil.Process] = []
    try:
        procs.append(psutil.Process(pid))
        procs.extend(procs[0].children(recursive=True))
    except psutil.Error:
        pass
    procs.extend(tagged(tag))
    kill_all(procs)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    late = tagged(tag)  # started while the others were killed
    kill_all(late)
    return wait_gone([*procs, *late], timeout=30)


def run_bounded(argv: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)``, except that on
    the timeout every process the command started is killed, not only the command: it runs in a
    session of its own with a unique ``TAG_VAR`` in its environment (:func:`kill_tree`).

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds, once the whole tree is gone; its
            ``output`` and ``stderr`` are what the command printed until then.
    """
    tag = uuid.uuid4().hex
    with subprocess.Popen([str(a) for a in argv], env={**env, TAG_VAR: tag}, cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            alive = kill_tree(popen.pid, tag)
            try:
                out, err = popen.communicate(timeout=30)  # every writer is gone: the pipes end
            except subprocess.TimeoutExpired:
                out, err = "", ""
            left = f"; still alive after SIGKILL: {[p.pid for p in alive]}" if alive else ""
            raise subprocess.TimeoutExpired(popen.args, timeout, output=out, stderr=(err or "") + left) from None
    return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class FtrunProc:
    """One ``python -m ftrun`` process started by a test, its output going to files."""

    def __init__(self, args: Sequence[str], *, cwd: Path, env: dict[str, str], tag: str, argv0: Sequence[str] | None = None):
        self.cwd = cwd
        self.tag = tag
        n = len(list(cwd.glob("ftrun_stdout_*.txt")))
        self.stdout_path = cwd / f"ftrun_stdout_{n}.txt"
        self.stderr_path = cwd / f"ftrun_stderr_{n}.txt"
        argv0 = list(argv0) if argv0 is not None else [sys.executable, "-m", "ftrun"]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(
                [*argv0, *args],
                cwd=cwd,
                env={**env, TAG_VAR: tag},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def wait(self, timeout: float = 90.0) -> Result:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"ftrun did not exit within {timeout} s\nstdout:\n{self.stdout()}\nstderr:\n{self.stderr()}"
                        f"{self.dump_stacks()}")
        return Result(code, self.stdout(), self.stderr())

    def dump_stacks(self) -> str:
        """The Python stacks of the launcher (in its stderr) and of its supervisor or agent (in its
        log's tail), asked for with SIGUSR1 (``ftrun.common.procs.dump_stacks_on_sigusr1``): where a
        launcher that did not exit was stuck."""
        try:
            launcher = psutil.Process(self.pid)
            for proc in [launcher, *launcher.children()]:
                proc.send_signal(signal.SIGUSR1)
        except psutil.Error:
            return ""
        time.sleep(1.0)
        args = list(self.popen.args)
        logs = Path(args[args.index("--log_dir") + 1]) if "--log_dir" in args else None
        own = sorted(logs.glob("supervisor.log")) + sorted(logs.glob("agent_*.log")) if logs else []
        tails = "".join(f"\n{p.name} (tail):\n" + "\n".join(p.read_text(errors="replace").splitlines()[-60:]) for p in own)
        return f"\nstderr after SIGUSR1:\n{self.stderr()}{tails}"

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for_files(self, paths: Sequence[Path], timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until every path exists (JSON files written atomically) and return their contents.

        Fails at once if ftrun exits first.
        """
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            if self.popen.poll() is not None:
                pytest.fail(
                    f"ftrun exited with {self.popen.returncode} before {[str(p) for p in paths if not p.exists()]} "
                    f"appeared\nstdout:\n{self.stdout()}\nstderr:\n{self.stderr()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{[str(p) for p in paths if not p.exists()]} did not appear within {timeout} s")
            time.sleep(0.05)
        return [json.loads(p.read_text()) for p in paths]

    def cleanup(self) -> None:
        """SIGKILL ftrun and everything it started, wherever it was reparented."""
        procs: list[psutil.Process] = []
        try:
            procs.append(psutil.Process(self.pid))
            procs.extend(psutil.Process(self.pid).children(recursive=True))
        except psutil.Error:
            pass
        procs.extend(tagged(self.tag))
        kill_all(procs)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        kill_all(tagged(self.tag))
        wait_gone(procs, timeout=30)


@pytest.fixture
def ftrun_proc(tmp_path: Path) -> Callable[..., FtrunProc]:
    """Start ``python -m ftrun ARGS`` in ``tmp_path`` (or ``cwd``); every process is killed at teardown.

    Call as ``ftrun_proc(args, env=None, cwd=None, argv0=None)``; ``env`` is added to a clean
    environment (no FTRUN_*, MS_ENABLE_TFT or TORCHELASTIC_* of the caller's).
    """
    started: list[FtrunProc] = []

    def start(args: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None,
              argv0: Sequence[str] | None = None) -> FtrunProc:
        proc = FtrunProc([str(a) for a in args], cwd=cwd or tmp_path, env=clean_env(env),
                         tag=uuid.uuid4().hex, argv0=argv0)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.cleanup()


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    """The objects of LOG_DIR/events.jsonl, in order."""
    path = log_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kinds(events: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


# --------------------------------------------------------------------------- the digits job's references


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the fault-free 4-rank digits job (STEPS steps), shared by the test files."""
    import digits_job
    from once import shared_once

    def run() -> str:
        digest, events, _ = digits_job.run(tmp_path_factory.mktemp("reference"))
        assert not [e for e in events if e["kind"] in ("rank_failed", "recovery_started", "rank_hung")]
        return digest

    return shared_once(tmp_path_factory, "reference", run)


@pytest.fixture(scope="session")
def long_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the fault-free long run (LONG_STEPS steps)."""
    import digits_job
    from once import shared_once

    return shared_once(tmp_path_factory, "long_reference", lambda: digits_job.run(
        tmp_path_factory.mktemp("long_reference"), steps=digits_job.LONG_STEPS)[0])


@pytest.fixture(scope="session")
def soak_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_sha256 of the fault-free SOAK_STEPS run (the soak and the hot-spare tests)."""
    import digits_job
    from once import shared_once

    return shared_once(tmp_path_factory, "soak_reference", lambda: digits_job.run(
        tmp_path_factory.mktemp("soak_reference"), steps=digits_job.SOAK_STEPS)[0])


#: Test files whose tests run on one pytest-xdist worker, one after the other (``--dist loadgroup``):
#: the Slurm cluster's (a machine-wide resource: its daemons, its module fixture), and files whose
#: tests share one costly module fixture, made once per worker that runs one of them (the hot
#: spares' six-fault job, about 55 s; word_lm's torchrun twin).
SERIAL_GROUPS = {"test_slurm.py": "slurm", "test_hot_spares.py": "spare_job", "test_word_lm.py": "word_lm"}


#: Files whose tests take longest (each 30 to 115 s, multi-host and Slurm jobs), run first: pytest-xdist
#: hands tests out in collection order, so the suite's end is made of short tests that fill both
#: workers rather than one long job that keeps one worker busy while the other idles.
LONG_FIRST = ("test_slurm.py", "test_soak.py", "test_multinode.py", "test_hot_spares.py", "test_ttp.py")


def _order(item: pytest.Item) -> tuple[int, int]:
    name = item.path.name
    if name in LONG_FIRST:
        return 0, LONG_FIRST.index(name)
    return (1 if item.get_closest_marker("integration") is not None else 2), 0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Multi-process tests get one rerun (see :data:`RERUNS`): they run real ranks on a busy 2-core
    machine, where a rare interleaving the suite has not met before must not sink the whole run
    unseen; a test that fails twice fails. Tests of :data:`SERIAL_GROUPS` share an xdist group.
    The longest files go first (:data:`LONG_FIRST`), then the other multi-process tests, then the
    process-free ones (a stable sort: each file keeps its order)."""
    items.sort(key=_order)
    for item in items:
        group = SERIAL_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if RERUNS <= 0 or not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("integration") is not None and item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=RERUNS))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List every test that failed and was run again, with the end of its first failure."""
    reruns = terminalreporter.stats.get("rerun", [])
    if not reruns:
        return
    terminalreporter.section(f"{len(reruns)} failure(s) that passed or failed on a rerun (each is a defect to find)")
    for report in reruns:
        text = str(report.longrepr or "")
        terminalreporter.write_line(f"{report.nodeid}:")
        for line in text.splitlines()[-60:]:
            terminalreporter.write_line(f"    {line}")


# --------------------------------------------------------------------------- processes a test left behind

_TEST_TAG = pytest.StashKey[str]()
_SPAWNS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec"})
_spawned = [False]  # whether the running test started a process (scanning every process costs ~60 ms)


def _audit(event: str, _args: tuple) -> None:
    if event in _SPAWNS:
        _spawned[0] = True


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Run the test's body with its tag in the environment (fixtures set up before it, such as a
    module's Slurm cluster, do not carry it)."""
    tag = uuid.uuid4().hex
    item.stash[_TEST_TAG] = tag
    os.environ[TEST_TAG_VAR] = tag
    _spawned[0] = False
    try:
        return (yield)
    finally:
        os.environ.pop(TEST_TAG_VAR, None)


def leftovers(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``TEST_TAG_VAR=tag``: what a test started."""
    return tagged(tag, TEST_TAG_VAR)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"{proc.pid}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the test's fixtures are torn down: a process that carries the test's tag and does not
    end within :data:`LEFTOVER_GRACE_S` is SIGKILLed and the test errors, naming each."""
    try:
        return (yield)
    finally:
        tag = item.stash.get(_TEST_TAG, None)
        if tag is not None and _spawned[0]:
            _spawned[0] = False
            found = leftovers(tag)
            left = wait_gone(found, timeout=LEFTOVER_GRACE_S) if found else []
            if left:
                names = [_describe(p) for p in left]
                kill_all(left)
                wait_gone(left, timeout=30)
                pytest.fail(f"{len(left)} process(es) of this test left behind (killed now):\n  " + "\n  ".join(names),
                            pytrace=False)

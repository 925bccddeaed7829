"""ftrun's own processes import the installed ftrun whatever the job's working directory holds.

``python -m`` puts the working directory first on ``sys.path``: a job started from a directory
holding a folder named ``ftrun`` (a clone of this repository, say) had its supervisor and spares
import that folder, and a promoted warm spare died with "module 'ftrun' has no attribute 'init'"
(one more restart per recovery). Here the working directory holds a decoy ``ftrun`` package whose
import raises; the scripts the spares run still get their own directory first on ``sys.path``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import digits_job as dj
import pytest

import ftrun
from ftrun.common import contract, procs
from ftrun.node import spawner

INSTALLED = str(Path(ftrun.__file__).resolve())

# A script the spare runs: where its ftrun came from, its sys.path and argv, and whether a module
# beside it (found only through the script's own sys.path entry) imports.
_PROBE = """
import json, sys
import ftrun
try:
    import beside
    found = beside.NAME
except ImportError:
    found = None
print("PROBE " + json.dumps({"ftrun": ftrun.__file__, "path": sys.path, "argv": sys.argv[1:], "beside": found}))
"""


def _decoy(where: Path) -> Path:
    """A directory holding an ``ftrun`` package whose import fails."""
    (where / "ftrun").mkdir(parents=True)
    (where / "ftrun" / "__init__.py").write_text("raise ImportError('the decoy ftrun of the working directory was imported')\n")
    return where


def _probe_result(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0][len("PROBE "):])


def _path_of_plain_python(cwd: Path, env: dict[str, str]) -> list[str]:
    """``sys.path`` of ``python -c`` started in ``cwd`` with ``env`` (its first entry: ``''``)."""
    done = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env=env, check=True)
    return json.loads(done.stdout)


def test_the_decoy_shadows_ftrun_under_plain_python_m(tmp_path: Path) -> None:
    """The premise of this file: in the decoy's directory, ``python -m ftrun`` imports the decoy."""
    done = subprocess.run([sys.executable, "-m", "ftrun", "--help"], cwd=_decoy(tmp_path), capture_output=True,
                          text=True, timeout=60, env=dj.env())
    assert done.returncode != 0 and "the decoy ftrun" in done.stderr, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("safe", [False, pytest.param(True, marks=pytest.mark.skipif(
    sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's"))])
def test_ftrun_module_argv_runs_the_installed_package_without_the_working_directory(tmp_path: Path, safe: bool) -> None:
    """The command line of ftrun's own processes (supervisor, agents, spares): the module runs as
    ``__main__`` with its arguments, from the installed package, and ``sys.path`` is what
    ``python -c`` would have without its working-directory entry. Under ``PYTHONSAFEPATH``
    Python puts no such entry first, and nothing else is removed."""
    cwd = _decoy(tmp_path / "job")
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "pathprobe.py").write_text(
        "import importlib.util, json, sys\n"
        "if __name__ == '__main__':\n"
        "    print('PROBE ' + json.dumps({'path': sys.path, 'argv': sys.argv[1:],\n"
        "                                 'ftrun': importlib.util.find_spec('ftrun.rank.spare').origin}))\n")
    env = dj.env({"PYTHONPATH": str(probes), **({"PYTHONSAFEPATH": "1"} if safe else {})})
    done = subprocess.run(procs.ftrun_module_argv("pathprobe", ["--hot", "x"], unbuffered=True), cwd=cwd,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = _probe_result(done.stdout)
    expected = _path_of_plain_python(cwd, env)
    assert (expected[0] == "") is not safe  # python -c puts the working directory first, unless safe
    assert seen["path"] == (expected if safe else expected[1:])
    assert seen["argv"] == ["--hot", "x"]
    assert str(Path(seen["ftrun"]).resolve().parents[1]) == str(Path(INSTALLED).parent)


def _spare_job(tmp_path: Path, module: bool) -> tuple[Path, Path, list[str]]:
    """(working directory with the decoy, the script's directory, argv): a probe script in a
    directory of its own (or a module in the working directory, as ``python -m`` finds it), with
    a module ``beside`` it that only the script's own ``sys.path`` entry makes importable."""
    cwd = _decoy(tmp_path / "job")
    where = cwd if module else tmp_path / "scripts"
    where.mkdir(exist_ok=True)
    (where / "probe.py").write_text(_PROBE)
    (where / "beside.py").write_text(f"NAME = {str(where)!r}\n")
    return cwd, where, (["probe"] if module else [str(where / "probe.py")]) + ["--lr", "0.1"]


@pytest.mark.parametrize("kind,module", [("warm", False), ("warm", True), ("hot", False)])
def test_a_spare_imports_the_installed_ftrun_and_gives_the_script_its_own_path(tmp_path: Path, kind: str,
                                                                                module: bool) -> None:
    """A spare started as the spawner starts it, in a working directory holding a decoy ``ftrun``:
    it imports the installed ftrun (and torch), then runs the script with the script's directory
    first on ``sys.path`` (the working directory for a module, as ``python -m`` has it)."""
    cwd, where, argv = _spare_job(tmp_path, module)
    env = dj.env()
    job = {"argv": argv, "module": module, "cwd": str(cwd)}
    log = tmp_path / "worker_1.log"
    if kind == "hot":
        env.update({contract.HOT_SPARE: "1", contract.SPARE_JOB: json.dumps(job)})
    spare = subprocess.Popen(spawner.spare_argv(kind == "hot"), cwd=cwd, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assignment = json.dumps({**job, "env": env, "log": str(log)}).encode() if kind == "warm" else b""
    out, _ = spare.communicate(assignment, timeout=180)
    output = out.decode(errors="replace") + (log.read_text() if log.exists() else "")
    assert spare.returncode == 0, output[-3000:]
    seen = _probe_result(output)
    assert str(Path(seen["ftrun"]).resolve()) == INSTALLED, seen
    assert seen["argv"] == ["--lr", "0.1"]
    assert seen["beside"] == str(where), seen
    # The script's entry first, then python -c's path without its working-directory entry: the
    # spare's own is gone, nothing else is.
    assert seen["path"] == [str(where), *_path_of_plain_python(cwd, env)[1:]], seen


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_job_started_beside_a_folder_named_ftrun_recovers_in_its_warm_spare(reference: str, tmp_path: Path) -> None:
    """The user's case: the 4-rank digits job started (with the ``ftrun`` command) from a directory
    holding a decoy ``ftrun`` package, rank 1 killed in step 20's all-reduce. The warm spare takes
    the rank: one restart, the fault-free run's digest."""
    launcher = shutil.which("ftrun", path=str(Path(sys.executable).parent))
    assert launcher, f"no ftrun command beside {sys.executable}: install the package (pip install -e .)"
    cwd = _decoy(tmp_path)
    log_dir = cwd / "logs"
    cmd = dj.cmd(log_dir)
    assert cmd[:3] == [sys.executable, "-m", "ftrun"]
    env = dj.env({"FTRUN_FAULT": "rank=1,step=20,point=allreduce,kind=kill"})
    done = subprocess.run([launcher, *cmd[3:]], env=env, capture_output=True, text=True, timeout=200, cwd=cwd)
    events = dj.events(log_dir)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}\n{dj.story(events)}"
    assert dj.digest(done.stdout) == reference, dj.story(events)
    dj.assert_survivors_kept_pids(events, {1})
    started = [e for e in events if e["kind"] == "rank_started"]
    assert len(started) == 5 and started[-1]["rank"] == 1, dj.story(events)
    assert started[-1]["detail"].get("warm_spare") is True, started[-1]

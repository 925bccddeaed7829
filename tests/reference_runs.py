"""Reference runs under plain torchrun (no ftrun in the process): what a test's faulted ftrun run
must end equal to.

torch 2.13 itself sometimes aborts a gloo rank of such a run with "terminate called without an
active exception" (SIGABRT: a joinable ``std::thread`` destroyed), at start-up or after the rank's
final line. Seen in CI under load, 4 times in 2 minutes (plain DDP twins, the plain Hugging Face
Trainer) and never in 12 runs on an idle or busy machine. It is torch's defect, not the
reference's result, so such a run is made again, as is one in which torchrun reports a rank
ended by ``SIGABRT`` without that line in the output (seen once in CI: an FSDP twin's rank, exit
code -6); any other failure is returned as it is. A run
made again first finds ``cwd`` as the first run found it: what an aborted run wrote there (a
checkpoint, say) is removed, or the next run would see it (Lightning's ``ModelCheckpoint`` then
names its file ``...-v1.ckpt``, and the reference is not the run a test compares with).

A run that does not end within its timeout is killed whole (torchrun and every rank, each of
which torchrun starts in a session of its own: :func:`conftest.run_bounded`), never torchrun alone,
which would leave the ranks running as orphans.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from conftest import run_bounded

TORCH_ABORT = "terminate called without an active exception"
RANK_ABORTED = re.compile(r"exitcode\s*:\s*-6\b")  # torchrun's report of a rank ended by SIGABRT
TRIES = 3


def run_torchrun(args: Sequence[str], env: dict[str, str], cwd: Path, timeout: float = 280) -> subprocess.CompletedProcess:
    """``torchrun <args>`` (text output captured), made again up to :data:`TRIES` times in all
    while it fails with :data:`TORCH_ABORT` or :data:`RANK_ABORTED` in its output. The caller
    checks the exit code.

    Raises:
        subprocess.TimeoutExpired: a run did not end within ``timeout`` seconds (every process
            of it killed)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    found = set(Path(cwd).rglob("*"))
    for attempt in range(1, TRIES + 1):
        _remove_all_but(Path(cwd), found)
        proc = run_bounded([str(torchrun), *args], env=env, cwd=cwd, timeout=timeout)
        output = proc.stdout + proc.stderr
        if proc.returncode == 0 or not (TORCH_ABORT in output or RANK_ABORTED.search(output)) or attempt == TRIES:
            return proc
        print(f"reference run: torch aborted a rank ({TORCH_ABORT!r}); run {attempt + 1} of at most {TRIES}",
              file=sys.stderr)
    raise AssertionError("unreachable")


def _remove_all_but(cwd: Path, kept: set[Path]) -> None:
    """Remove every file and directory under ``cwd`` that is not in ``kept`` (deepest first)."""
    for path in sorted(set(cwd.rglob("*")) - kept, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

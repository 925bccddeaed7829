"""A whole-job restart of an unmodified PyTorch Lightning script resumes from Lightning's own
newest checkpoint.

An unmodified script under ftrun (or torchrun with ``--max-restarts``) is restarted as a whole on a
fault, and its ``trainer.fit(...)`` starts again from step 0 unless the script passes
``ckpt_path``. Run it through this module instead, with no change to the script::

    ftrun --worker_num 4 -m ftrun.integrations.lightning_resume train.py ...
    torchrun --nproc_per_node 4 --max-restarts 3 -m ftrun.integrations.lightning_resume train.py ...

It runs ``train.py`` as ``__main__`` (as ``python train.py`` would) after patching
``lightning.pytorch.Trainer.fit``: in a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0, set
by both launchers), a ``fit`` called without ``ckpt_path`` resumes from the newest checkpoint file
(by modification time) in the directory of each of the Trainer's ``ModelCheckpoint`` callbacks
(``last.ckpt`` with ``save_last=True``, else the newest top-k file; what ``ckpt_path="last"``
would find, and more), through Lightning's own resume path (``fit(ckpt_path=...)``: model,
optimizer, schedulers, loops, callbacks). The first attempt, and an attempt that finds no
checkpoint, train as the script says. Only the steps up to the newest saved checkpoint survive,
and Lightning itself does not restore the random streams or a plain ``DataLoader``'s place inside
an epoch: what ftrun's rank-level recovery (:class:`ftrun.integrations.lightning.FTStrategy`)
keeps, this does not.
"""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import sys
from typing import Any

from ftrun.common.contract import RankEnv

USAGE = "usage: python -m ftrun.integrations.lightning_resume SCRIPT [ARGS...]"
#: Lightning's checkpoint file extension (``ModelCheckpoint.FILE_EXTENSION``).
EXTENSION = ".ckpt"


def checkpoint_to_resume(trainer: Any, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The newest ``*.ckpt`` file (modification time) in the ``dirpath`` of ``trainer``'s
    ``ModelCheckpoint`` callbacks if this process belongs to a restarted attempt
    (``TORCHELASTIC_RESTART_COUNT`` or ``FTRUN_ATTEMPT`` > 0), else None. A callback without a
    ``dirpath`` (Lightning chooses it at ``fit``) is looked for in ``default_root_dir/checkpoints``
    (Lightning's choice without a logger)."""
    if RankEnv.from_environ(environ).attempt <= 0:
        return None
    from lightning.pytorch.callbacks import ModelCheckpoint

    found: dict[str, float] = {}
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        directory = callback.dirpath or os.path.join(trainer.default_root_dir, "checkpoints")
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if name.endswith(EXTENSION) and os.path.isfile(path):
                found[path] = os.path.getmtime(path)
    return max(found, key=found.__getitem__) if found else None


def install() -> None:
    """Patch ``lightning.pytorch.Trainer.fit`` (once): see the module docstring."""
    from lightning.pytorch import Trainer

    original = Trainer.fit
    if getattr(original, "ftrun_resume", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("ckpt_path") is None:
            found = checkpoint_to_resume(self)
            if found is not None:
                if self.is_global_zero:
                    print(f"ftrun: attempt {RankEnv.from_environ(os.environ).attempt}: resuming from {found}",
                          file=sys.stderr, flush=True)
                bound.arguments["ckpt_path"] = found
        return original(*bound.args, **bound.kwargs)

    fit.ftrun_resume = True  # type: ignore[attr-defined]
    Trainer.fit = fit  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """Install the patch and run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``.
    Exit code 2 with one line when no script is given or it does not exist."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"ftrun.integrations.lightning_resume: no such script: {script}", file=sys.stderr)
        return 2
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

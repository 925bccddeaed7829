"""A whole-job restart of an unmodified Hugging Face ``Trainer`` script resumes from the Trainer's
own newest checkpoint.

An unmodified script under ftrun (or torchrun with ``--max-restarts``) is restarted as a whole on a
fault, and its ``trainer.train()`` starts again from step 0 unless the script passes
``resume_from_checkpoint``. Run it through this module instead, with no change to the script::

    ftrun --worker_num 4 -m ftrun.integrations.hf_resume train.py --output_dir out ...
    torchrun --nproc_per_node 4 --max-restarts 3 -m ftrun.integrations.hf_resume train.py ...

It runs ``train.py`` as ``__main__`` (as ``python train.py`` would) after patching
``transformers.Trainer.train``: in a restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0, set by
both launchers), a ``train()`` called without ``resume_from_checkpoint`` resumes from the newest
``output_dir/checkpoint-N`` (``transformers.trainer_utils.get_last_checkpoint``), through the
Trainer's own resume path (model, optimizer, scheduler, ``TrainerState``, RNG, the data skipped).
The first attempt, and an attempt that finds no checkpoint, train as the script says. Only steps
up to the newest ``save_steps`` checkpoint survive: what ftrun's rank-level recovery
(:class:`ftrun.integrations.hf.FTTrainer`) keeps, this does not.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from typing import Any

from ftrun.common.contract import RankEnv

USAGE = "usage: python -m ftrun.integrations.hf_resume SCRIPT [ARGS...]"


def checkpoint_to_resume(output_dir: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The newest ``checkpoint-N`` in ``output_dir`` if this process belongs to a restarted attempt
    (``TORCHELASTIC_RESTART_COUNT`` or ``FTRUN_ATTEMPT`` > 0), else None."""
    if not output_dir or RankEnv.from_environ(environ).attempt <= 0 or not os.path.isdir(output_dir):
        return None
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir)


def install() -> None:
    """Patch ``transformers.Trainer.train`` (once): see the module docstring."""
    from transformers import Trainer

    original = Trainer.train
    if getattr(original, "ftrun_resume", False):
        return

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint in (None, False):
            found = checkpoint_to_resume(self.args.output_dir)
            if found is not None:
                if self.is_world_process_zero():
                    print(f"ftrun: attempt {RankEnv.from_environ(os.environ).attempt}: resuming from {found}",
                          file=sys.stderr, flush=True)
                resume_from_checkpoint = found
        return original(self, resume_from_checkpoint, *args, **kwargs)

    train.ftrun_resume = True  # type: ignore[attr-defined]
    Trainer.train = train  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """Install the patch and run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``.
    Exit code 2 with one line when no script is given or it does not exist."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"ftrun.integrations.hf_resume: no such script: {script}", file=sys.stderr)
        return 2
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

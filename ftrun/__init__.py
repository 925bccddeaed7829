"""ftrun: a fault-tolerant launcher for distributed PyTorch training.

Run a script with ``ftrun --worker_num 4 train.py``. Inside the script, the worker library (this
package's top level) reports progress and, with :func:`init`, lets ftrun recover a failed rank in
place: see :mod:`ftrun.rank.worker`. Importing ``ftrun`` does not import torch; the worker library loads
it when first used.
"""

from __future__ import annotations

from typing import Any

from ftrun.common import __version__

__all__ = ["__version__", "report", "init", "RecoverableError", "Worker"]


def report(step: int, **metrics: Any) -> None:
    """Report the current step and metrics (e.g. ``loss=0.31``) to the ftrun console.

    Cheap (a queued message); a no-op when the script does not run under ftrun.

    Args:
        step: the training step just finished (0-based).
        **metrics: numbers or short strings shown on the console (loss, lr, tokens/s...).
    """
    from ftrun.rank import worker

    worker.report(step, **metrics)


def __getattr__(name: str) -> Any:
    if name == "RecoverableError":
        from ftrun.errors import RecoverableError

        return RecoverableError
    if name in ("init", "Worker"):
        from ftrun.rank import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")

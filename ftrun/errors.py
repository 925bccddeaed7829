"""Exceptions a training script may raise or catch; importing them does not import torch."""

from __future__ import annotations


class RecoverableError(RuntimeError):
    """An error after which a rank can repair itself in place (MindSpore's UCE).

    Raise it (or a subclass) inside a step guarded by ``with step:``, or let the optimizer wrapper
    see it during the update: the rank stays alive, reloads its state from a replica peer, and every
    rank retries the step. Other exception types can be declared recoverable with
    ``--recoverable_errors`` (e.g. ``torch.OutOfMemoryError``).
    """


def describe(err: BaseException) -> str:
    """``"Type: first line of the message"``: an exception in one line, for logs and reports."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"

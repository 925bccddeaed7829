"""The digits example, checking that the user's side of the process survives recoveries.

In its set-up (a respawned rank too) it asks ``torch.distributed`` for its rank and world size; in
a step whose collectives failed (``opt.step()`` returned False) it asks again and prints what it got.

With ``FTRUN_TEST_ECHO=host:port`` it also holds a TCP connection of its own to that echo server:
``hello <rank> <incarnation>`` at set-up, ``step`` after each optimizer step and ``end <rank>
<incarnation>`` at the end, each answered before it goes on; a connection that stopped working
ends the rank with an error (ftrun's release of a blocked collective touches only its
own group's connections). The training is the example's, bit for bit.
"""

import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_digits  # noqa: E402

ft = ftrun.init(backend="gloo", seed=0)
print(f"set-up: dist rank {dist.get_rank()} of {dist.get_world_size()}, incarnation {ft.incarnation}", flush=True)
wrap_optimizer = ft.wrap_optimizer
echo = None
if os.environ.get("FTRUN_TEST_ECHO"):
    host, port = os.environ["FTRUN_TEST_ECHO"].rsplit(":", 1)
    echo = socket.create_connection((host, int(port)), timeout=30).makefile("rw", encoding="utf-8")


def say(line: str) -> None:
    if echo is None:
        return
    try:
        echo.write(line + "\n")
        echo.flush()
        answer = echo.readline()
    except OSError as err:
        raise RuntimeError(f"the script's own connection broke: {err!r}") from None
    if answer != line + "\n":
        raise RuntimeError(f"the script's own connection broke: sent {line!r}, got {answer!r}")


def checked(optimizer, name="optimizer"):  # type: ignore[no-untyped-def]
    wrapped = wrap_optimizer(optimizer, name)
    step = wrapped.step

    def checked_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        ok = step(*args, **kwargs)
        if not ok:
            print(f"failed step: dist rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
        say("step")
        return ok

    wrapped.step = checked_step
    return wrapped


me = f"{ft.rank} {ft.incarnation}"
say(f"hello {me}")
ft.wrap_optimizer = checked
code = train_digits.main(sys.argv[1:])
say(f"end {me}")
sys.exit(code)

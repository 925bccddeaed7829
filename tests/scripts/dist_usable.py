"""The digits example, checking that torch.distributed stays usable around recoveries.

In its set-up (a respawned rank too) it asks ``torch.distributed`` for its rank and world size; in
a step whose collectives failed (``opt.step()`` returned False) it asks again and prints what it got.
The training is the example's, bit for bit.
"""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_digits  # noqa: E402

ft = ftrun.init(backend="gloo", seed=0)
print(f"set-up: dist rank {dist.get_rank()} of {dist.get_world_size()}, incarnation {ft.incarnation}", flush=True)
wrap_optimizer = ft.wrap_optimizer


def checked(optimizer, name="optimizer"):  # type: ignore[no-untyped-def]
    wrapped = wrap_optimizer(optimizer, name)
    step = wrapped.step

    def checked_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        ok = step(*args, **kwargs)
        if not ok:
            print(f"failed step: dist rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
        return ok

    wrapped.step = checked_step
    return wrapped


ft.wrap_optimizer = checked
sys.exit(train_digits.main(sys.argv[1:]))

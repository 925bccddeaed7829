"""The digits example with a set-up that needs its rank: ``rank_in_setup.py MODE args...``.

MODE ``ft.rank`` reads ``ftrun.init().rank`` before the training loop (a hot spare waits there for
its promotion); MODE ``env`` reads ``os.environ["RANK"]`` (absent in a hot spare: it fails, and its
node keeps warm spares). Either way the training is the example's, bit for bit.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ftrun  # noqa: E402
import train_digits  # noqa: E402

mode = sys.argv.pop(1)
rank = int(os.environ["RANK"]) if mode == "env" else ftrun.init(backend="gloo", seed=0).rank
print(f"set-up of rank {rank}", flush=True)
sys.exit(train_digits.main(sys.argv[1:]))

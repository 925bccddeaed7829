"""The digits example whose set-up is slow in a hot spare: ``slow_spare_setup.py HOLD args...``.

A process started without a rank (a hot spare, before its promotion) waits in its set-up while the
file HOLD exists, so a test can fault a rank while the node's hot spare is certainly still in its
set-up. It reads only whether ``RANK`` is set, never its value. The training is the example's, bit
for bit.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_digits  # noqa: E402

hold = Path(sys.argv.pop(1))
if "RANK" not in os.environ:
    print(f"hot spare (pid {os.getpid()}) in its set-up", flush=True)
    while hold.exists():
        time.sleep(0.05)
sys.exit(train_digits.main(sys.argv[1:]))

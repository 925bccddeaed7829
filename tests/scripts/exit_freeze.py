"""Prints whether the collector was frozen by the time the exit handlers registered before
``ftrun.init`` ran (they run after the ones registered later, ``init``'s included)."""
import atexit
import gc
import sys

atexit.register(lambda: print(f"frozen at exit: {gc.get_freeze_count()}", flush=True))

import ftrun  # noqa: E402

print(f"frozen before exit: {gc.get_freeze_count()}", flush=True)
ft = ftrun.init(backend="gloo")
print(f"frozen after init: {gc.get_freeze_count()}", flush=True)
ft.finish()
sys.exit(0)

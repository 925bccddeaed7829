"""Two ftrun trees against each other and against torchrun on examples/word_lm.py:
rounds of base, new and torchrun in turn, the median step time of rank 0 of each run (the gaps
between its ``--step-times`` lines, the first tenth left out), then each tree's pairwise median
against torchrun. A change worth a few percent needs this: the machine's own pace moves by more
than that between runs minutes apart.

    .venv/bin/python scripts/bench_ab.py --base /tmp/old-clone --new . --rounds 6 --size small

``--base``/``--new`` are put first on the ranks' PYTHONPATH (a clone of the repository at another
commit); ``--base ''`` runs only the new tree and torchrun; ``--base-flags``/``--new-flags`` add ftrun flags
to each side's runs (the same tree twice: ``--base . --new-flags '--warm_spares 0'``). Figures in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LARGE = ["--emsize", "128", "--nhid", "128", "--bptt", "35", "--batch_size", "8"]


def median_step_ms(kind: str, tree: str | None, size: str, epochs: int, workdir: Path, flags: str = "") -> float:
    """One run: the median gap between rank 0's step lines, in ms (NaN if it printed none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if tree:
        env["PYTHONPATH"] = tree
    script = ROOT / "examples" / ("word_lm_torchrun.py" if kind == "torchrun" else "word_lm.py")
    common = [str(script), "--epochs", str(epochs), "--step-times", "--train-lines", "3000",
              *(LARGE if size == "large" else [])]
    logs = workdir / f"logs-{kind}"
    shutil.rmtree(logs, ignore_errors=True)
    shutil.rmtree(workdir / "ftrun_checkpoints", ignore_errors=True)  # a dying gasp would be resumed
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone", *common]
    else:
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain",
               "--tail_worker_log", "0", "--log_dir", str(logs), *shlex.split(flags), *common]
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True).stdout
    if kind != "torchrun":
        out = (logs / "worker_0.log").read_text(errors="replace")
    times = [float(m.group(1)) for m in re.finditer(r"^step \d+ loss \S+ time (\S+)", out, re.M)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    gaps = gaps[len(gaps) // 10:]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="", help="the tree to compare against ('' for none)")
    parser.add_argument("--new", default=str(ROOT), help="the tree under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--size", choices=("small", "large"), default="small")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--base-flags", default="", help="ftrun flags of the base runs (e.g. '--warm_spares 0')")
    parser.add_argument("--new-flags", default="", help="ftrun flags of the new runs")
    args = parser.parse_args()
    kinds = [("base", args.base), ("new", args.new), ("torchrun", None)]
    flags = {"base": args.base_flags, "new": args.new_flags, "torchrun": ""}
    if not args.base:
        kinds = kinds[1:]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ftrun-ab-") as tmp:
        for r in range(args.rounds):
            for kind, tree in kinds:
                results.setdefault(kind, []).append(median_step_ms(kind, tree, args.size, args.epochs, Path(tmp), flags[kind]))
            print(r, {k: f"{v[-1]:.2f}" for k, v in results.items()}, flush=True)
    for kind, values in results.items():
        print(f"{kind:9s} median {statistics.median(values):.2f} ms  all {[round(x, 2) for x in values]}")
    for kind, values in results.items():
        if kind != "torchrun":
            ratio = statistics.median(a / b for a, b in zip(values, results["torchrun"]))
            print(f"{kind} pairwise vs torchrun: median {100 * (ratio - 1):+.1f}%")


if __name__ == "__main__":
    main()

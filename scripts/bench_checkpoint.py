"""Benchmark: what periodic asynchronous checkpoints cost a training step.

A plain single-process CPU training loop (an MLP trained with Adam) is timed three ways:

- ``none``: no checkpoint;
- ``async``: :class:`ftrun.common.checkpoint.AsyncCheckpointer` saves model + optimizer state after
  *every* step (snapshot at the step boundary, written by the background thread);
- ``sync``: the same save done inline with :func:`ftrun.common.checkpoint.save_shard` (for reference).

For each model (a large one, width 2048 with four hidden layers: 13.7 M parameters, 164 MB
of saved state with Adam's moments; and a small one) it prints the mean and median step time,
the overhead of saving against ``none``, the time ``save()`` blocked training (snapshot copy plus
any wait for the previous write), the background write time, and the process CPU time per step
(all threads; less sensitive than wall time to other load on the machine, though torch's
spinning worker threads count in it). Every step is saved, so the
background write must take less than a step or training waits for it; the step time is set by
``--batch``. Run::

    python scripts/bench_checkpoint.py                 # both models, default sizes
    python scripts/bench_checkpoint.py --models large --steps 30 --batch-large 2048

With ``--digits``, it also runs the real 4-rank digits job under ftrun with and without
``--save_steps 1`` and prints the median step time from rank 0's own timestamps.

Figures are printed, not asserted (benchmarks measure speed, tests do not).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ftrun.common import checkpoint as ckpt

MODELS = {"large": (2048, 4), "small": (256, 2)}  # (hidden width, hidden layers)


def build(hidden: int, layers: int, inputs: int = 512, classes: int = 10) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(inputs, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(hidden, classes))
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def state_bytes(state: object) -> int:
    total = 0

    def walk(obj: object) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return total


def run(mode: str, hidden: int, layers: int, batch: int, steps: int, warmup: int, root: Path) -> dict[str, float]:
    """Train ``warmup + steps`` steps; returns timing figures (seconds) of the last ``steps``."""
    model, opt = build(hidden, layers)
    x = torch.randn(batch, 512)
    y = torch.randint(0, 10, (batch,))
    saver = ckpt.AsyncCheckpointer(root, shard=0, keep=2, single_writer=True) if mode == "async" else None
    times, cpu, blocked, writes = [], [], [], []
    for step in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mode == "async":
            assert saver is not None
            blocked.append(saver.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}))
            writes.append(saver.last_write_s)  # the previous step's write (finished: save waited for it)
        elif mode == "sync":
            t = time.perf_counter()
            directory = ckpt.step_dir(root, step)
            info = ckpt.save_shard(directory, 0, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
            ckpt.write_manifest(directory, step, 1, [[0]], {0: info}, reason="periodic")
            ckpt.prune(root, 2)
            writes.append(time.perf_counter() - t)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    if saver is not None:
        saver.close()
        saver.wait()
    times, cpu, blocked, writes = times[warmup:], cpu[warmup:], blocked[warmup:], writes[warmup + 1 :] if mode == "async" else writes[warmup:]
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    return {
        "mean": statistics.fmean(times),
        "median": statistics.median(times),
        "cpu": statistics.fmean(cpu),
        "blocked": statistics.fmean(blocked) if blocked else 0.0,
        "write": statistics.fmean(writes) if writes else 0.0,
        "bytes": float(state_bytes(state)),
        "params": float(sum(p.numel() for p in model.parameters())),
    }


def digits_step_time(save_steps: int, steps: int) -> float:
    """Median seconds per step of ``ftrun --worker_num 4 examples/train_digits.py`` (rank 0's
    ``step N loss L time T`` lines, after 20 warm-up steps), checkpointing every ``save_steps``."""
    work = Path(tempfile.mkdtemp(prefix="ftrun-bench-digits-"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain",
               "--tail_worker_log", "0", "--log_dir", str(work / "logs"), "--checkpoint_dir", str(work / "ckpt"),
               "--save_steps", str(save_steps), str(Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"),
               "--steps", str(steps), "--log_every", "1"]
        proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:])
        log = (work / "logs" / "worker_0.log").read_text()
        stamps = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"step (\d+) loss \S+ time (\S+)", log)]
        gaps = [t1 - t0 for (s0, t0), (s1, t1) in zip(stamps, stamps[1:]) if s1 == s0 + 1 and s0 >= 20]
        return statistics.median(gaps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["large", "small"])
    parser.add_argument("--modes", nargs="+", choices=["none", "async", "sync"], default=["none", "async", "sync"])
    parser.add_argument("--batch-large", type=int, default=2048, help="batch of the large model (sets its step time)")
    parser.add_argument("--batch-small", type=int, default=2048, help="batch of the small model")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved; the best mean is kept")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for training (default: torch's choice); 1 on 2 cores leaves a core to the writer, "
                             "as a GPU job leaves its CPU cores")
    parser.add_argument("--digits", action="store_true", help="also time the 4-rank digits job with --save_steps 1")
    parser.add_argument("--digits-steps", type=int, default=300)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.digits:
        runs = {0: [], 1: []}
        for _ in range(args.repeats):
            for save in (0, 1):
                runs[save].append(digits_step_time(save, args.digits_steps))
        none, every = min(runs[0]), min(runs[1])
        print(f"digits job, 4 ranks, {args.digits_steps} steps: step {none * 1e3:.2f} ms without checkpoints, "
              f"{every * 1e3:.2f} ms with --save_steps 1 ({(every / none - 1) * 100:+.1f}%); best of {args.repeats}", flush=True)
    base = args.dir or Path(tempfile.mkdtemp(prefix="ftrun-bench-ckpt-"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; checkpoints in {base}; every step saved", flush=True)
    try:
        for name in args.models:
            hidden, layers = MODELS[name]
            batch = args.batch_large if name == "large" else args.batch_small
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeats):
                for mode in args.modes:
                    root = base / f"{name}-{mode}"
                    shutil.rmtree(root, ignore_errors=True)
                    result = run(mode, hidden, layers, batch, args.steps, args.warmup, root)
                    if mode not in best or result["mean"] < best[mode]["mean"]:
                        best[mode] = result
                    shutil.rmtree(root, ignore_errors=True)
            any_result = next(iter(best.values()))
            print(
                f"\n{name}: MLP width {hidden} x {layers} layers, {any_result['params'] / 1e6:.1f} M params, "
                f"saved state {any_result['bytes'] / 1e6:.0f} MB (model + Adam), batch {batch}"
            )
            base_mean = best["none"]["mean"] if "none" in best else None
            base_cpu = best["none"]["cpu"] if "none" in best else None
            for mode in args.modes:
                r = best[mode]
                overhead = f"{(r['mean'] / base_mean - 1) * 100:+6.1f}%" if base_mean else "   n/a"
                cpu_overhead = f"{(r['cpu'] / base_cpu - 1) * 100:+6.1f}%" if base_cpu else "   n/a"
                extra = ""
                if mode == "async":
                    extra = f"  save() blocked {r['blocked'] * 1e3:7.1f} ms, background write {r['write'] * 1e3:7.1f} ms"
                elif mode == "sync":
                    extra = f"  inline save {r['write'] * 1e3:7.1f} ms"
                print(f"  {mode:5s} step mean {r['mean'] * 1e3:8.1f} ms  median {r['median'] * 1e3:8.1f} ms  overhead {overhead}  CPU {r['cpu'] * 1e3:8.1f} ms/step ({cpu_overhead}){extra}")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

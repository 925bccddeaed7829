"""Draw the documentation's pictures from a real run: the live console and the report's timeline.

Runs the digits example on 2 ranks with rank 1 killed inside step 60's all-reduce, draws the
console's view of the job (as ``ftrun status`` draws it) two seconds after the recovery as SVG
(rich's own export), lets the job finish, and draws ``ftrun report --plot``'s timeline. The
pictures are then those of the code that draws them, from a run of the code they show.

Usage: .venv/bin/python scripts/docs_pictures.py [--out docs/img] [--steps 300]
Writes OUT/console.svg and OUT/timeline.png; takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _recovered(events: Path) -> bool:
    if not events.exists():
        return False
    for line in events.read_text().splitlines():
        try:
            if json.loads(line).get("kind") == "recovery_finished":
                return True
        except ValueError:
            continue
    return False


def draw_console(log_dir: Path, target: Path, width: int = 118) -> None:
    """Draw the job in LOG_DIR as the console shows it, into TARGET (SVG)."""
    from rich.console import Console

    from ftrun.status import read_snapshot, rich_view

    console = Console(record=True, width=width, file=open(os.devnull, "w"), force_terminal=True)
    console.print(rich_view(read_snapshot(log_dir)))
    console.save_svg(str(target), title="ftrun")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="directory for the pictures")
    parser.add_argument("--steps", type=int, default=300, help="steps of the digits job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the run may take")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ftrun_pictures_") as tmp:
        log_dir = Path(tmp) / "logs"  # shown as "logs": the job and the drawing run in TMP
        env = {**os.environ, "FTRUN_FAULT": "rank=1,step=60,point=allreduce,kind=kill"}
        command = [sys.executable, "-m", "ftrun", "--worker_num", "2", "--plain", "--log_dir", "logs",
                   "--checkpoint_dir", str(Path(tmp) / "ckpt"), "--tail_worker_log", "",
                   str(ROOT / "examples" / "train_digits.py"), "--steps", str(args.steps)]
        job = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.timeout
        try:
            while not _recovered(log_dir / "events.jsonl"):
                if job.poll() is not None or time.monotonic() > deadline:
                    print("docs_pictures: the job ended or timed out before its recovery", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            time.sleep(2.0)  # two seconds after the recovery, as the console is shown in the docs
            here = Path.cwd()
            os.chdir(tmp)
            try:
                draw_console(Path("logs"), out.resolve() / "console.svg")
            finally:
                os.chdir(here)
            code = job.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        if code != 0:
            print(f"docs_pictures: the job exited {code}", file=sys.stderr)
            return 1
        report = subprocess.run([sys.executable, "-m", "ftrun", "report", str(log_dir), "--plot", str(out / "timeline.png")],
                                capture_output=True, text=True)
        if report.returncode != 0:
            print(report.stdout + report.stderr, file=sys.stderr)
            return 1
    print(f"docs_pictures: wrote {out / 'console.svg'} and {out / 'timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

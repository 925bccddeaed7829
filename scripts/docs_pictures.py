"""Draw the documentation's pictures from a real run: the live console and the report's timeline.

Runs the digits example on 2 ranks with rank 1 killed inside step 60's all-reduce, draws the
console's view of the job (as ``ftrun status`` draws it) two seconds after the recovery as SVG
(rich's own export), lets the job finish, and draws ``ftrun report --plot``'s timeline. The
pictures are then those of the code that draws them, from a run of the code they show.

It also draws the benchmarks page's headline recovery times (ftrun against torchrun, from the
page's own table, so the bars are the figures the page states) as OUT/headline.png.

Usage: .venv/bin/python scripts/docs_pictures.py [--out docs/img] [--steps 300] [--headline_only]
Writes OUT/console.svg, OUT/timeline.png and OUT/headline.png; takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

    from ftrun.tools.status import read_snapshot, rich_view

    console = Console(record=True, width=width, file=open(os.devnull, "w"), force_terminal=True)
    console.print(rich_view(read_snapshot(log_dir)))
    console.save_svg(str(target), title="ftrun")


def headline_rows(benchmarks: Path) -> list[tuple[str, float, float, str]]:
    """The rows of the benchmarks page's headline table whose ftrun and torchrun cells both start
    with a time in seconds: (figure, ftrun seconds, torchrun seconds, the page's torchrun/ftrun
    ratio: a median of pairs, not the ratio of the two medians)."""
    text = benchmarks.read_text()
    table = text[text.index("## Headline figures"):]
    table = table[:table.index("\n\n", table.index("| figure"))]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        ft, tr = (re.match(r"([0-9.]+) s\b", cell) for cell in cells[1:3])
        if ft and tr:
            rows.append((cells[0], float(ft.group(1)), float(tr.group(1)), cells[3]))
    return rows


def draw_headline(benchmarks: Path, target: Path) -> None:
    """Bars of the headline recovery times, ftrun against torchrun (seconds, log scale), into TARGET."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = headline_rows(benchmarks)
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.2))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r[2] for r in rows], height=0.4, label="torchrun", color="#bbbbbb")
    ax.barh([y - 0.2 for y in ys], [r[1] for r in rows], height=0.4, label="ftrun", color="#1f77b4")
    for y, (_, ft, tr, ratio) in zip(ys, rows):
        ax.text(ft * 1.05, y - 0.2, f"{ft:g} s", va="center", fontsize=8)
        ax.text(tr * 1.05, y + 0.2, f"{tr:g} s (torchrun/ftrun {ratio}, pairwise)", va="center", fontsize=8)
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(r[2] for r in rows) * 12)
    ax.set_xlabel("seconds from the fault until training is back (log scale)")
    ax.set_title("Recovery time after a fault: ftrun against torchrun (benchmarks page, headline figures)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="directory for the pictures")
    parser.add_argument("--steps", type=int, default=300, help="steps of the digits job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the run may take")
    parser.add_argument("--headline_only", action="store_true", help="draw only the benchmarks' headline bars")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    draw_headline(ROOT / "docs" / "benchmarks.md", out / "headline.png")
    if args.headline_only:
        print(f"docs_pictures: wrote {out / 'headline.png'}")
        return 0
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
    print(f"docs_pictures: wrote {out / 'console.svg'}, {out / 'timeline.png'} and {out / 'headline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The documentation a user reads: a short README, a docs site whose every page is in the navigation,
a CLI reference written from the option table, today's behaviour only (no project history in the
product), and benchmarks that name their command and machine. No processes, no network: the site
itself is built by ``mkdocs build --strict`` in CI (.ci/run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))

import mkdocs_hooks  # noqa: E402  (scripts/mkdocs_hooks.py: the site's build hook)


def _nav_pages() -> list[str]:
    """The pages named in mkdocs.yml's navigation, relative to docs/."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return re.findall(r":\s+([\w./-]+\.md)\s*$", nav, flags=re.M)


def _help_flags() -> set[str]:
    """Every flag ``ftrun --help`` prints."""
    out = subprocess.run([sys.executable, "-m", "ftrun", "--help"], capture_output=True, text=True,
                         env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    options = out.stdout[out.stdout.index("Options:"):]
    return {flag for line in options.splitlines() if line.lstrip().startswith("-")
            for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", line.strip().split("  ")[0])}


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 300]
    assert long == [], f"README lines over 300 characters: {long}"


def test_readme_test_command_is_what_ci_runs() -> None:
    """The README's test command is .ci/run's pytest line, word for word."""
    ci = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in line)
    command = ci.split("  #")[0].strip()
    assert command in (ROOT / "README.md").read_text()


def test_no_project_history_in_the_product() -> None:
    """Code, tests, docs and README speak of today: no 'issue N' or 'session N' (git keeps the history)."""
    pattern = re.compile(r"\b(session|issue) [0-9]+")
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "ftrun").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
                 *sorted(DOCS.rglob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    assert found == []


def test_every_page_is_in_the_navigation_and_exists() -> None:
    nav = _nav_pages()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages
    assert len(nav) == len(set(nav)), "a page is twice in the navigation"


def test_cli_reference_lists_every_flag_of_help() -> None:
    """The CLI reference's table is written from the option table, as ``ftrun --help`` is: every flag
    of ``--help`` is on the page, and every option's variable."""
    from ftrun.config import OPTIONS

    page = (DOCS / mkdocs_hooks.PAGE).read_text()
    assert mkdocs_hooks.MARKER in page
    table = mkdocs_hooks.options_markdown()
    flags = _help_flags()
    assert {"--worker_num", "--nproc-per-node", "--standalone", "-m", "--plain", "--help"} <= flags
    missing = sorted(flag for flag in flags if f"`{flag}`" not in table)
    assert missing == []
    assert [opt.name for opt in OPTIONS if f"`{opt.env_var}`" not in table] == []


def test_cli_reference_names_only_real_flags() -> None:
    """The hand-written parts of the CLI reference (torchrun's flags) name only flags the command has."""
    import typer

    from ftrun.cli import app

    page = (DOCS / mkdocs_hooks.PAGE).read_text()
    named = {flag for row in page.splitlines() if row.startswith("| `")
             for flag in re.findall(r"`(--?[a-z][a-z_-]*)", row.split("|")[1])}
    flags = {flag for param in typer.main.get_command(app).params for flag in param.opts}
    assert named and named <= flags, sorted(named - flags)


def test_every_benchmark_names_its_command_and_machine() -> None:
    """Each figure section of the benchmarks page shows the command that gives it and the machine."""
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    machines = ("CPU machine", "Namespace hosts", "Slurm cluster")
    figures = [s for s in sections if "```\n" in s and s.split("\n", 1)[0] not in ("Machine", "How it is measured")]
    assert len(figures) >= 10
    for section in figures:
        title = section.split("\n", 1)[0]
        if title == "Headline figures":
            continue
        assert re.search(r"```bash\n.*(scripts/|pytest)", section), f"{title}: no command"
        assert any(m in section for m in machines), f"{title}: no machine"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (DOCS / image).exists(), image


@pytest.mark.parametrize("picture", ["img/console.svg", "img/timeline.png"])
def test_pictures_of_a_real_run_are_there(picture: str) -> None:
    """scripts/docs_pictures.py draws them from a real run."""
    assert (DOCS / picture).stat().st_size > 1000


def test_environment_page_lists_every_options_variable() -> None:
    """The environment page's table of ``FTRUN_<OPTION>`` variables is written from the option table too."""
    from ftrun.config import OPTIONS

    assert mkdocs_hooks.ENV_MARKER in (DOCS / mkdocs_hooks.ENV_PAGE).read_text()
    table = mkdocs_hooks.variables_markdown()
    assert [opt.name for opt in OPTIONS if f"`{opt.env_var}` | `--{opt.name}`" not in table] == []


def test_headline_plot_is_drawn_from_the_benchmarks_table() -> None:
    """scripts/docs_pictures.py draws the headline bars from the benchmarks page's own table."""
    import docs_pictures

    rows = docs_pictures.headline_rows(DOCS / "benchmarks.md")
    assert len(rows) >= 6
    assert all(ft < tr for _, ft, tr, _ in rows)
    assert (DOCS / "img" / "headline.png").exists()

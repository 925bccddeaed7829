"""mkdocs hooks (``hooks:`` in mkdocs.yml): the CLI reference's option table, written at build time.

The table comes from the one place the ``ftrun`` command's flags come from: the ``run`` command
that :mod:`ftrun.cli` builds from the option table (:data:`ftrun.config.OPTIONS`, the fields of
:class:`ftrun.config.JobSpec`) and from :class:`ftrun.config.TorchrunFlags`. Every flag of
``ftrun --help`` is a row; an option's row adds its default, its range and its ``FTRUN_<NAME>``
variable. ``tests/test_docs.py`` checks that the page lists every flag of ``ftrun --help``.
"""

from __future__ import annotations

from typing import Any

#: The line of docs/reference/cli.md that the generated table replaces.
MARKER = "<!-- ftrun: the options table, generated from ftrun.config.OPTIONS -->"
#: The page that holds it, relative to docs/.
PAGE = "reference/cli.md"
#: The line of docs/reference/environment.md that the table of the options' variables replaces.
ENV_MARKER = "<!-- ftrun: the options' variables, generated from ftrun.config.OPTIONS -->"
ENV_PAGE = "reference/environment.md"


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def options_markdown() -> str:
    """The table of every flag of the ``ftrun`` command, as markdown (one row per parameter)."""
    import typer

    from ftrun.cli import app
    from ftrun.config import OPTIONS

    options = {opt.name: opt for opt in OPTIONS}
    rows = ["| flag | default | range | variable | meaning |", "| --- | --- | --- | --- | --- |"]
    for param in typer.main.get_command(app).params:
        flags = [*param.opts, *getattr(param, "secondary_opts", [])]
        if not any(flag.startswith("-") for flag in flags):
            continue  # SCRIPT and its arguments
        names = ", ".join(f"`{flag}`" for flag in flags)
        opt = options.get(param.name or "")
        if opt is None:
            rows.append(f"| {names} | | | | {_cell(param.help or '')} |")
            continue
        if opt.default is None:
            default = "computed"
        elif opt.type is bool:
            default = str(opt.default).lower()
        else:
            default = f"`{opt.default}`" if str(opt.default) != "" else "''"
        rows.append(f"| {names} | {default} | {_cell(opt.range_text())} | `{opt.env_var}` | {_cell(opt.help)} |")
    rows.append("| `-h`, `--help` | | | | Show the options and exit. |")
    return "\n".join(rows)


def variables_markdown() -> str:
    """The table of every option's ``FTRUN_<NAME>`` variable and its flag, as markdown."""
    from ftrun.config import OPTIONS

    rows = ["| variable | flag | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{opt.env_var}` | `--{opt.name}` | {_cell(opt.help)} |" for opt in OPTIONS]
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs event: put the generated tables in the CLI reference and environment pages."""
    for name, marker, make in ((PAGE, MARKER, options_markdown), (ENV_PAGE, ENV_MARKER, variables_markdown)):
        if page.file.src_uri == name:
            if marker not in markdown:
                raise ValueError(f"{name} has lost its marker line: {marker}")
            markdown = markdown.replace(marker, make())
    return markdown

"""Resolving a job's configuration the way the command line does, for tests."""

from __future__ import annotations

from pathlib import Path

from ftrun.config import OPTIONS, JobSpec, resolve


def cli(**values):
    """CLI values as the CLI passes them: every option present, None where not given."""
    out = {opt.name: None for opt in OPTIONS}
    out.update(values)
    return out


def res(tmp_path: Path, script: str, cli_values=None, environ=None, config_file=None, **kw) -> JobSpec:
    return resolve(
        cli(**(cli_values or {})),
        script=script,
        environ=environ or {},
        cwd=tmp_path,
        config_file=None if config_file is None else str(config_file),
        **kw,
    )

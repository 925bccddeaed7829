"""Unit tests of ftrun.config and ftrun.policy (no processes, fast)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

import ftrun.cli
import ftrun.node.launcher
from ftrun.config import (
    MAX_CONFIG_BYTES,
    MAX_TIMEOUT_S,
    OPTIONS,
    OPTIONS_BY_NAME,
    ConfigError,
    JobSpec,
    TftSwitches,
    TorchrunFlags,
    check_address,
    parse_nnodes,
    parse_rdzv_conf,
    parse_rdzv_endpoint,
    parse_std_streams,
    parse_tail,
    parse_tft,
    read_job_token,
    read_toml,
    resolve,
)
from ftrun.common.faults import parse_faults

from config_fixtures import cli, res

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# A shared secret for multi-node jobs (they refuse to start without one).
TOKEN = "0123456789abcdef0123"
TOKEN_ENV = {"FTRUN_TOKEN": TOKEN}


# --------------------------------------------------------------------------- defaults & precedence


def test_defaults(tmp_path, script):
    spec = res(tmp_path, script)
    assert spec.worker_num == 1 and spec.local_worker_num == 1
    assert spec.master_addr == "127.0.0.1" and spec.master_port == 29500
    assert spec.node_rank == 0 and spec.log_dir == "ftrun_logs"
    assert spec.join is False and spec.max_restarts == 3
    assert spec.tail_worker_log is None  # -1: every local rank
    assert spec.tft.arf is True  # with no switch anywhere, ARF is on
    assert spec.config_file is None
    assert spec.script == script and spec.script_args == ()


def test_local_worker_num_defaults_to_worker_num(tmp_path, script):
    spec = res(tmp_path, script, {"worker_num": "4"})
    assert spec.worker_num == 4 and spec.local_worker_num == 4 and spec.nnodes == 1


def _layers(tmp_path: Path):
    pyproject = write(tmp_path / "pyproject.toml", "[project]\nname='x'\n[tool.ftrun]\nworker_num = 5\nmax_restarts = 5\n"
                      "grace_period = 5.5\nmaster_addr = '10.0.0.5'\n")
    config = write(tmp_path / "cfg.toml", "worker_num = 4\nmax_restarts = 4\ngrace_period = 4.5\n")
    env = {"FTRUN_WORKER_NUM": "3", "FTRUN_MAX_RESTARTS": "3"}
    return pyproject, config, env


def test_precedence_cli_beats_env_beats_config(tmp_path, script):
    _, config, env = _layers(tmp_path)
    spec = res(tmp_path, script, {"worker_num": "2"}, environ=env, config_file=config)
    assert spec.worker_num == 2  # CLI
    assert spec.max_restarts == 3  # env
    assert spec.grace_period == 4.5  # --config
    assert spec.master_addr == "127.0.0.1"  # pyproject is not read when --config is given
    assert spec.monitor_interval == 0.1  # default
    assert spec.config_file == str(config)


def test_precedence_env_beats_pyproject(tmp_path, script):
    _layers(tmp_path)
    spec = res(tmp_path, script, environ={"FTRUN_WORKER_NUM": "3"})
    assert spec.worker_num == 3  # env
    assert spec.max_restarts == 5 and spec.grace_period == 5.5 and spec.master_addr == "10.0.0.5"  # pyproject


def test_pyproject_beats_defaults_and_other_tables_ignored(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[tool.other]\nworker_num = 'x'\n[tool.ftrun]\nlog-dir = 'L'\n")
    spec = res(tmp_path, script)
    assert spec.log_dir == "L" and spec.worker_num == 1


def test_pyproject_without_ftrun_table(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[project]\nname = 'x'\n")
    assert res(tmp_path, script).worker_num == 1


def test_empty_env_value_is_ignored(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = 4\n")
    assert res(tmp_path, script, environ={"FTRUN_WORKER_NUM": "  "}, config_file=config).worker_num == 4


def test_config_file_ftrun_table_and_hyphenated_keys(tmp_path, script):
    config = write(
        tmp_path / "cfg.toml",
        "[ftrun]\nworker-num = 4\nlocal-worker-num = 2\nmaster-port = 1234\nnode-rank = 1\n"
        "tail-worker-log = '0'\njoin = true\ncluster-time-out = 7\n",
    )
    spec = res(tmp_path, script, config_file=config, environ=TOKEN_ENV)
    assert (spec.worker_num, spec.local_worker_num, spec.master_port, spec.node_rank) == (4, 2, 1234, 1)
    assert spec.tail_worker_log == (0,) and spec.join is True and spec.cluster_time_out == 7.0
    assert spec.global_rank(1) == 3


def test_pyproject_hyphenated_keys(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[tool.ftrun]\nmax-restarts = 0\nmonitor-interval = 0.5\n")
    spec = res(tmp_path, script)
    assert spec.max_restarts == 0 and spec.monitor_interval == 0.5


def test_env_types(tmp_path, script):
    env = {"FTRUN_JOIN": "yes", "FTRUN_GRACE_PERIOD": "0", "FTRUN_MASTER_PORT": " 0 ", "FTRUN_TAIL_WORKER_LOG": ""}
    spec = res(tmp_path, script, environ=env)
    assert spec.join is True and spec.grace_period == 0.0 and spec.master_port == 0
    assert spec.tail_worker_log is None


def test_toml_integral_float_for_int_ok(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = 2.0\n")
    assert res(tmp_path, script, config_file=config).worker_num == 2


def test_tail_worker_log_parsing(tmp_path, script):
    assert res(tmp_path, script, {"worker_num": "4", "tail_worker_log": "0, 3"}).tail_worker_log == (0, 3)
    assert res(tmp_path, script, {"worker_num": "4", "tail_worker_log": ""}).tail_worker_log == ()
    assert res(tmp_path, script, {"worker_num": "4", "tail_worker_log": "-1"}).tail_worker_log is None
    assert parse_tail("1 2", 3) == (1, 2)


def test_script_args_module_and_no_python(tmp_path):
    spec = resolve(cli(), script="json", script_args=("a", "--b"), module=True, environ={}, cwd=tmp_path)
    assert spec.module and spec.script_args == ("a", "--b")
    spec = resolve(cli(), script="sh", no_python=True, environ={}, cwd=tmp_path)
    assert spec.no_python


# --------------------------------------------------------------------------- TFT switches


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{ARF:1,TTP:1}", TftSwitches(arf=True, ttp=True, uce=False, hcce=False)),
        ("ARF:1 TTP:1", TftSwitches(arf=True, ttp=True, uce=False, hcce=False)),
        ("  { arf : 1 ,  ttp:0 }  ", TftSwitches(arf=True, ttp=True, uce=False, hcce=False)),  # ARF implies TTP
        ("{UCE:1}", TftSwitches(arf=False, ttp=True, uce=True, hcce=False)),  # UCE implies TTP
        ("{TTP:1}", TftSwitches(arf=False, ttp=True, uce=False, hcce=False)),
        ("{ARF:0}", TftSwitches(arf=False, ttp=False, uce=False, hcce=False)),
        ("{hcce:1,Arf:0}", TftSwitches(arf=False, ttp=False, uce=False, hcce=True)),
        ("{ARF:1, ,TTP:1,}", TftSwitches(arf=True, ttp=True, uce=False, hcce=False)),
        ("{}", TftSwitches(arf=False, ttp=False, uce=False, hcce=False)),  # named nothing: all off
        ("{ARF:0,ARF:1}", TftSwitches(arf=True, ttp=True, uce=False, hcce=False)),  # last one wins
    ],
)
def test_parse_tft(text, expected):
    assert parse_tft(text) == expected


def test_tft_helpers():
    sw = parse_tft("{ARF:1,UCE:1,HCCE:1}")
    assert sw.enabled() == ["ARF", "TTP", "UCE", "HCCE"]
    assert sw.not_implemented() == []
    assert str(sw) == "{ARF:1,TTP:1,UCE:1,HCCE:1}"
    assert parse_tft(str(sw)) == sw


@pytest.mark.parametrize(
    "text, hint",
    [
        ("{FOO:1}", "unknown switch"),
        ("{ARF:2}", "cannot read"),
        ("{ARF:1", "unbalanced"),
        ("ARF:1}", "unbalanced"),
        ("{ARF=1}", "cannot read"),
        ("{ARF}", "cannot read"),
        ("{ARF:yes}", "cannot read"),
    ],
)
def test_parse_tft_errors(text, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        parse_tft(text, source="MS_ENABLE_TFT")
    assert "MS_ENABLE_TFT" in str(info.value)
    assert "\n" not in str(info.value)


def test_tft_default_when_nothing_given(tmp_path, script):
    tft = res(tmp_path, script).tft
    assert tft.arf and tft.ttp and tft.uce and tft.hcce


def test_ftrun_tft_beats_ms_enable_tft(tmp_path, script):
    env = {"FTRUN_TFT": "{ARF:0}", "MS_ENABLE_TFT": "{ARF:1,UCE:1}"}
    assert res(tmp_path, script, environ=env).tft == TftSwitches(arf=False, ttp=False, uce=False, hcce=False)


def test_ms_enable_tft_used_alone(tmp_path, script):
    env = {"MS_ENABLE_TFT": "{UCE:1}"}
    assert res(tmp_path, script, environ=env).tft == TftSwitches(arf=False, ttp=True, uce=True, hcce=False)


def test_ms_enable_tft_error_names_it(tmp_path, script):
    with pytest.raises(ConfigError, match="MS_ENABLE_TFT"):
        res(tmp_path, script, environ={"MS_ENABLE_TFT": "{ARF:2}"})


def test_ftrun_tft_error_names_it(tmp_path, script):
    with pytest.raises(ConfigError, match="FTRUN_TFT"):
        res(tmp_path, script, environ={"FTRUN_TFT": "{BAD:1}", "MS_ENABLE_TFT": "{ARF:1}"})


def test_cli_tft_beats_env(tmp_path, script):
    spec = res(tmp_path, script, {"tft": "{ARF:0}"}, environ={"FTRUN_TFT": "{ARF:1}"})
    assert spec.tft.arf is False


def test_tft_from_toml_string_and_table(tmp_path, script):
    config = write(tmp_path / "a.toml", "tft = '{UCE:1}'\n")
    assert res(tmp_path, script, config_file=config).tft.uce is True
    config = write(tmp_path / "b.toml", "[ftrun]\ntft = {ARF = 0, HCCE = 1}\n")
    assert res(tmp_path, script, config_file=config).tft == TftSwitches(arf=False, ttp=False, uce=False, hcce=True)


# --------------------------------------------------------------------------- resolve errors


@pytest.mark.parametrize(
    "cli_values, environ, hint",
    [
        ({"worker_num": "0"}, {}, "--worker_num must be at least 1"),
        ({"worker_num": "-3"}, {}, "--worker_num must be at least 1"),
        ({"worker_num": "2", "local_worker_num": "4"}, {}, "larger than --worker_num"),
        ({"worker_num": "2", "local_worker_num": "0"}, {}, "--local_worker_num must be at least 1"),
        ({"worker_num": "5", "local_worker_num": "2"}, {}, "not a multiple"),
        ({"worker_num": "4", "local_worker_num": "2", "node_rank": "2", "master_port": "1234"}, {}, "outside 0..1"),
        ({"node_rank": "-1"}, {}, "--node_rank must be at least 0"),
        ({"master_port": "65536"}, {}, "--master_port must be at least 0 and at most 65535, got 65536 (a TCP port"),
        ({"master_port": "-1"}, {}, "--master_port must be at least 0"),
        ({"worker_num": "4", "local_worker_num": "2", "master_port": "0"}, {}, "one node only"),
        ({"max_restarts": "-1"}, {}, "--max_restarts must be at least 0"),
        ({"grace_period": "-0.5"}, {}, "--grace_period"),
        ({"monitor_interval": "0"}, {}, "--monitor_interval must be at least 0.001"),
        ({"cluster_time_out": "-1"}, {}, "--cluster_time_out must be more than 0"),
        ({"worker_num": "abc"}, {}, "'abc' is not valid for worker_num; it must be an integer"),
        ({"worker_num": "2.5"}, {}, "must be an integer"),
        ({"grace_period": "soon"}, {}, "must be a number"),
        ({"join": "maybe"}, {}, "must be true or false"),
        ({}, {"FTRUN_WORKER_NUM": "abc"}, "FTRUN_WORKER_NUM: 'abc' is not valid"),
        ({}, {"FTRUN_MASTER_PORT": "80.5"}, "FTRUN_MASTER_PORT"),
        ({}, {"FTRUN_JOIN": "2"}, "FTRUN_JOIN"),
        ({"worker_num": "2", "tail_worker_log": "2"}, {}, "not a local rank 0..1"),
        ({"worker_num": "2", "tail_worker_log": "0,x"}, {}, "--tail_worker_log"),
        ({"worker_num": "2", "tail_worker_log": "-2"}, {}, "--tail_worker_log"),
        ({"tft": "{XYZ:1}"}, {}, "unknown switch"),
        ({}, {"FTRUN_TFT": "{ARF:2}"}, "FTRUN_TFT"),
    ],
)
def test_resolve_errors(tmp_path, script, cli_values, environ, hint):
    with pytest.raises(ConfigError) as info:
        res(tmp_path, script, cli_values, environ=environ)
    message = str(info.value)
    assert hint in message
    assert "\n" not in message


def test_errors_from_env_layer_also_checked(tmp_path, script):
    with pytest.raises(ConfigError, match="FTRUN_WORKER_NUM must be at least 1"):
        res(tmp_path, script, environ={"FTRUN_WORKER_NUM": "0"})
    with pytest.raises(ConfigError, match="FTRUN_LOCAL_WORKER_NUM 3 is larger than FTRUN_WORKER_NUM 2"):
        res(tmp_path, script, environ={"FTRUN_LOCAL_WORKER_NUM": "3", "FTRUN_WORKER_NUM": "2"})


def test_unknown_toml_key(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = 2\nnum_workers = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'num_workers'") as info:
        res(tmp_path, script, config_file=config)
    assert "worker_num" in str(info.value)  # the known keys are listed


def test_unknown_key_in_pyproject(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[tool.ftrun]\nworkers = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'workers' in .*pyproject.toml \[tool.ftrun\]"):
        res(tmp_path, script)


def test_invalid_toml(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        res(tmp_path, script, config_file=config)
    assert "\n" not in str(info.value)


def test_invalid_pyproject(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[tool.ftrun\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        res(tmp_path, script)


def test_toml_wrong_type(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = 'many'\n")
    with pytest.raises(ConfigError, match=r"key worker_num in .*cfg.toml is a string \('many'\); worker_num takes an integer"):
        res(tmp_path, script, config_file=config)
    config = write(tmp_path / "cfg2.toml", "worker_num = true\n")
    with pytest.raises(ConfigError, match="is a boolean .* takes an integer"):
        res(tmp_path, script, config_file=config)


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_unreadable_toml(tmp_path, script, kind):
    path = tmp_path / "nope.toml"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(ConfigError, match="cannot read config file"):
        res(tmp_path, script, config_file=path)


def test_missing_script(tmp_path):
    with pytest.raises(ConfigError, match="script .*missing.py.* not found"):
        resolve(cli(), script=str(tmp_path / "missing.py"), environ={}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="no script given"):
        resolve(cli(), script=None, environ={}, cwd=tmp_path)
    (tmp_path / "adir.py").mkdir()
    with pytest.raises(ConfigError, match="not found"):
        resolve(cli(), script=str(tmp_path / "adir.py"), environ={}, cwd=tmp_path)


def test_missing_module(tmp_path):
    with pytest.raises(ConfigError, match="module 'no_such_module_xyz' not found"):
        resolve(cli(), script="no_such_module_xyz", module=True, environ={}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="module 'no_such_pkg_xyz.sub' not found"):
        resolve(cli(), script="no_such_pkg_xyz.sub", module=True, environ={}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        resolve(cli(), script=".relative", module=True, environ={}, cwd=tmp_path)


def test_missing_program(tmp_path):
    with pytest.raises(ConfigError, match="program 'no-such-program-xyz' not found"):
        resolve(cli(), script="no-such-program-xyz", no_python=True, environ={}, cwd=tmp_path)
    plain = write(tmp_path / "notexec.sh", "#!/bin/sh\n")
    plain.chmod(0o644)
    with pytest.raises(ConfigError, match="not found or not executable"):
        resolve(cli(), script=str(plain), no_python=True, environ={}, cwd=tmp_path)


def test_module_and_no_python_together(tmp_path):
    with pytest.raises(ConfigError, match="cannot be used together"):
        resolve(cli(), script="json", module=True, no_python=True, environ={}, cwd=tmp_path)


def test_read_toml_unknown_section_is_empty(tmp_path):
    path = write(tmp_path / "pyproject.toml", "[project]\nname='x'\n")
    assert read_toml(path, section=("tool", "ftrun")) == {}


# --------------------------------------------------------------------------- JobSpec JSON


def test_jobspec_json_round_trip(tmp_path, script):
    config = write(tmp_path / "cfg.toml", "tail_worker_log = '1,2'\n")
    spec = res(
        tmp_path,
        script,
        {"worker_num": "8", "local_worker_num": "4", "node_rank": "1", "tft": "{UCE:1,HCCE:1}"},
        config_file=config,
        script_args=("--lr", "0.1"),
        environ=TOKEN_ENV,
    )
    data = json.loads(json.dumps(spec.to_json()))
    assert JobSpec.from_json(data) == spec
    assert data["tail_worker_log"] == [1, 2] and data["script_args"] == ["--lr", "0.1"]
    assert data["tft"] == {"arf": False, "ttp": True, "uce": True, "hcce": True}


def test_jobspec_json_round_trip_defaults():
    spec = JobSpec(script="x.py")
    assert JobSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


# --------------------------------------------------------------------------- the CLI layer, in process


class FakeLauncher:
    """Stands in for ftrun.node.launcher.Launcher: records the spec, runs nothing."""

    specs: list[JobSpec] = []

    def __init__(self, spec, console=None):
        FakeLauncher.specs.append(spec)

    def run(self) -> int:
        return 0


@pytest.fixture
def cli_spec(tmp_path, monkeypatch, script):
    """Run ftrun.cli.main(argv) in process and return the JobSpec it would launch."""
    for key in list(__import__("os").environ):
        if key.startswith("FTRUN_") or key == "MS_ENABLE_TFT":
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ftrun.node.launcher, "Launcher", FakeLauncher)
    FakeLauncher.specs = []

    def run(*argv: str) -> JobSpec:
        with pytest.raises(SystemExit) as info:
            ftrun.cli.main(["--plain", *argv])
        assert info.value.code == 0
        return FakeLauncher.specs[-1]

    return run


def test_cli_hyphenated_flags(cli_spec, monkeypatch, script):
    monkeypatch.setenv("FTRUN_TOKEN", TOKEN)
    spec = cli_spec("--worker-num", "4", "--local-worker-num", "2", "--master-port", "1234", "--node-rank", "1",
                    "--max-restarts", "0", "--tail-worker-log", "1", "--grace-period", "2", script, "a", "--b")
    assert (spec.worker_num, spec.local_worker_num, spec.node_rank, spec.master_port) == (4, 2, 1, 1234)
    assert spec.max_restarts == 0 and spec.tail_worker_log == (1,) and spec.grace_period == 2.0
    assert spec.script_args == ("a", "--b")


def test_cli_script_args_not_parsed_as_options(cli_spec, script):
    spec = cli_spec("--worker_num", "2", script, "--worker_num", "7", "-m")
    assert spec.worker_num == 2 and spec.script_args == ("--worker_num", "7", "-m") and not spec.module


def test_cli_nproc_per_node_alone_sets_world(cli_spec, script):
    spec = cli_spec("--nproc_per_node", "3", script)
    assert spec.worker_num == 3 and spec.local_worker_num == 3


def test_cli_beats_env(cli_spec, monkeypatch, script):
    monkeypatch.setenv("FTRUN_WORKER_NUM", "2")
    monkeypatch.setenv("FTRUN_MAX_RESTARTS", "7")
    spec = cli_spec("--worker_num", "3", script)
    assert spec.worker_num == 3 and spec.max_restarts == 7


@pytest.mark.parametrize("flag", ["--local_worker_num", "--nproc_per_node"])
def test_cli_local_worker_num_keeps_worker_num_from_env(cli_spec, monkeypatch, script, flag):
    monkeypatch.setenv("FTRUN_TOKEN", TOKEN)
    # Two nodes of 2 ranks: the world size comes from the environment, the node's share from the CLI.
    monkeypatch.setenv("FTRUN_WORKER_NUM", "4")
    spec = cli_spec(flag, "2", "--master_port", "1234", script)
    assert spec.worker_num == 4 and spec.local_worker_num == 2 and spec.nnodes == 2


def test_cli_local_worker_num_keeps_worker_num_from_config(cli_spec, tmp_path, monkeypatch, script):
    monkeypatch.setenv("FTRUN_TOKEN", TOKEN)
    config = write(tmp_path / "cfg.toml", "worker_num = 4\n")
    spec = cli_spec("--config", str(config), "--local_worker_num", "2", "--master_port", "1234", script)
    assert spec.worker_num == 4 and spec.local_worker_num == 2


def test_cli_nproc_per_node_conflict(tmp_path, monkeypatch, script, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        ftrun.cli.main(["--nproc_per_node", "2", "--local_worker_num", "3", script])
    assert info.value.code == 2
    assert "disagree" in capsys.readouterr().err


# --------------------------------------------------------------------------- bounds of every number option


NUMBER_OPTIONS = [opt for opt in OPTIONS if opt.type in (int, float)]


def test_every_number_option_is_bounded():
    for opt in NUMBER_OPTIONS:
        assert opt.low is not None and opt.high is not None, opt.name
        assert opt.range_text(), opt.name
        if opt.name in ("cluster_time_out", "pg_timeout", "heartbeat_timeout", "step_timeout", "step_timeout_min",
                        "setup_timeout"):
            assert opt.high == MAX_TIMEOUT_S == 604800 and opt.unit == "s", opt.name
    for opt in OPTIONS:  # defaults are inside the bounds
        if opt.type in (int, float) and opt.default is not None:
            opt.check_range(opt.default, "default")


def _outside(opt):
    """Values of ``opt`` that must be refused, as text."""
    bad = [str(opt.high * 10 + 1), "-1e300" if opt.type is float else "-99999999"]
    if opt.type is float:
        bad += ["nan", "inf", "-inf", "1e15", "NaN", "infinity"]
        if opt.low_open:
            bad.append(str(opt.low))
    elif opt.low > 0:
        bad.append(str(opt.low - 1))
    return bad


@pytest.mark.parametrize("opt", NUMBER_OPTIONS, ids=[o.name for o in NUMBER_OPTIONS])
def test_number_option_bounds_on_every_layer(tmp_path, script, opt):
    for bad in _outside(opt):
        if opt.type is int and bad.startswith("-1e"):
            continue
        with pytest.raises(ConfigError) as info:
            res(tmp_path, script, {opt.name: bad})
        assert str(info.value).startswith(f"--{opt.name} must be ") and "\n" not in str(info.value), str(info.value)
        with pytest.raises(ConfigError, match=f"^FTRUN_{opt.name.upper()} must be "):
            res(tmp_path, script, environ={f"FTRUN_{opt.name.upper()}": bad})
    toml_bad = opt.high * 10 + 1 if opt.type is int else float(opt.high) * 10 + 1
    config = write(tmp_path / "cfg.toml", f"{opt.name} = {toml_bad}\n")
    with pytest.raises(ConfigError, match=f"^key {opt.name} in .*cfg.toml must be "):
        res(tmp_path, script, config_file=config)
    if opt.type is float:
        config = write(tmp_path / "nan.toml", f"{opt.name} = nan\n")
        with pytest.raises(ConfigError, match="got nan"):
            res(tmp_path, script, config_file=config)


@pytest.mark.parametrize(
    "name, value",
    [("pg_timeout", "604800"), ("cluster_time_out", "0.5"), ("monitor_interval", "0.001"),
     ("monitor_interval", "3600"), ("heartbeat_interval", "0.01"), ("grace_period", "0"), ("step_timeout", "0"),
     ("max_restarts", "0"), ("warm_spares", "64"), ("master_port", "65535"), ("save_steps", "1000000000")],
)
def test_bounds_themselves_are_accepted(tmp_path, script, name, value):
    spec = res(tmp_path, script, {name: value})
    assert getattr(spec, name) == OPTIONS_BY_NAME[name].type(value)


def test_range_error_gives_range_and_reason(tmp_path, script):
    with pytest.raises(ConfigError) as info:
        res(tmp_path, script, {"pg_timeout": "1e15"})
    assert str(info.value) == (
        "--pg_timeout must be more than 0 and at most 604800 s, got 1e15 (7 days is the longest timeout ftrun "
        "accepts; torch's timers overflow on far longer ones)"
    )


def test_help_shows_the_bounds(capsys):
    try:
        ftrun.cli.main(["--help"])
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    assert "Range: more than 0 and at most 604800 s." in text
    assert "Range: at least 0.001 and at most 3600 s." in text


@pytest.mark.parametrize("text", ["1_000", "١٢", "0x10", "1e3", " ", "2.0"])
def test_int_text_must_be_plain_digits(tmp_path, script, text):
    with pytest.raises(ConfigError, match="must be an integer"):
        res(tmp_path, script, {"max_restarts": text})


# --------------------------------------------------------------------------- TOML types


@pytest.mark.parametrize(
    "line, hint",
    [
        ("master_addr = [1, 2]", r"key master_addr in .*cfg.toml is an array \(\[1, 2\]\); master_addr takes a string"),
        ("log_dir = {a = 1}", "is a table .* log_dir takes a string"),
        ("resume = 3", "is an integer .* resume takes a string"),
        ("checkpoint_dir = true", "is a boolean .* checkpoint_dir takes a string"),
        ("run_id = 1979-05-27", "is a date/time"),
        ("worker_num = '2'", "is a string .* worker_num takes an integer, e.g. worker_num = 1"),
        ("worker_num = 2.5", "is a float .* takes an integer"),
        ("worker_num = [2]", "is an array"),
        ("pg_timeout = '30'", "pg_timeout takes a number, e.g. pg_timeout = 300.0"),
        ("pg_timeout = true", "is a boolean"),
        ("join = 1", "join takes true or false, e.g. join = true"),
        ("join = 'yes'", "join takes true or false"),
        ("tail_worker_log = [0, true]", "a string or an array of local ranks"),
        ("recoverable_errors = [1]", "a string or an array of strings"),
        ("tft = {ARF = 2}", "switch ARF = 2 must be true/false or 1/0"),
        ("tft = {ARF = 'yes'}", "switch ARF"),
        ("tft = [1]", "tft takes a string"),
        ("worker_num = inf", "is a float .* takes an integer"),
        ("worker_num = 1e300", "must be at least 1 and at most 1048576, got 1e\\+300"),
        ("pg_timeout = 1e400", "got inf"),
    ],
)
def test_toml_value_must_have_the_option_type(tmp_path, script, line, hint):
    config = write(tmp_path / "cfg.toml", line + "\n")
    with pytest.raises(ConfigError, match=hint) as info:
        res(tmp_path, script, config_file=config)
    assert "\n" not in str(info.value)


def test_toml_accepted_types(tmp_path, script):
    config = write(
        tmp_path / "cfg.toml",
        "worker_num = 4.0\npg_timeout = 30\nmonitor_interval = 0.5\njoin = true\ntail_worker_log = [0, 3]\n"
        "recoverable_errors = ['A', 'b.C']\ntft = {ARF = true, HCCE = 0}\nnnodes = 1\n",
    )
    spec = res(tmp_path, script, config_file=config)
    assert spec.worker_num == 4 and spec.pg_timeout == 30.0 and isinstance(spec.pg_timeout, float)
    assert spec.monitor_interval == 0.5 and spec.join is True and spec.tail_worker_log == (0, 3)
    assert spec.recoverable_errors == ("A", "b.C") and spec.tft == TftSwitches(arf=True, ttp=True, uce=False, hcce=False)
    write(tmp_path / "cfg.toml", "tail_worker_log = -1\n")
    assert res(tmp_path, script, config_file=tmp_path / "cfg.toml").tail_worker_log is None


def test_toml_binary_large_and_odd_files(tmp_path, script):
    (tmp_path / "bin.toml").write_bytes(b"worker_num = 2\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"bin.toml is not UTF-8 text \(byte 0xff at offset 15\)"):
        res(tmp_path, script, config_file=tmp_path / "bin.toml")
    write(tmp_path / "big.toml", "#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        res(tmp_path, script, config_file=tmp_path / "big.toml")
    write(tmp_path / "pyproject.toml", "[tool]\nftrun = 'x'\n")
    with pytest.raises(ConfigError, match=r"tool.ftrun in .*pyproject.toml is not a table"):
        res(tmp_path, script)
    write(tmp_path / "twice.toml", "[ftrun]\nmax-restarts = 1\nmax_restarts = 2\n")
    with pytest.raises(ConfigError, match="sets max_restarts twice"):
        res(tmp_path, script, config_file=tmp_path / "twice.toml")
    write(tmp_path / "nul.toml", 'master_addr = "a\\u0000b"\n')
    with pytest.raises(ConfigError, match="NUL"):
        res(tmp_path, script, config_file=tmp_path / "nul.toml")


def test_error_names_the_layer_that_gave_the_value(tmp_path, script):
    write(tmp_path / "pyproject.toml", "[tool.ftrun]\nworker_num = 2\nlocal_worker_num = 4\n")
    with pytest.raises(ConfigError, match=r"local_worker_num in .*pyproject.toml \[tool.ftrun\] 4 is larger than "
                                          r"worker_num in .*pyproject.toml \[tool.ftrun\] 2"):
        res(tmp_path, script)
    with pytest.raises(ConfigError, match="--local_worker_num 4 is larger than FTRUN_WORKER_NUM 2"):
        res(tmp_path, script, {"local_worker_num": "4"}, environ={"FTRUN_WORKER_NUM": "2"})


# --------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "given, expected",
    [("127.0.0.1", "127.0.0.1"), ("10.1.2.3", "10.1.2.3"), ("::1", "::1"), ("[::1]", "::1"),
     ("fe80::1%lo", "fe80::1%lo"), ("[10.0.0.1]", "10.0.0.1"), ("localhost", "localhost"), (" 127.0.0.1 ", "127.0.0.1")],
)
def test_check_address_accepts(given, expected):
    assert check_address(given, "--master_addr") == expected


@pytest.mark.parametrize(
    "given, hint",
    [("999.1.1.1", "not a valid IPv4 address"), ("1.2.3", "not a valid IPv4 address"),
     ("1.2.3.4.5", "not a valid IPv4 address"), ("", "is empty"), ("[]", "is empty"),
("fe80::zz", "not a valid IPv6"), ("bad_host!", "nor a valid host name"),
     ("-lead.example", "nor a valid host name"), ("no-such-host-ftrun-test.invalid", "cannot resolve host name")],
)
def test_check_address_refuses(given, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        check_address(given, "--master_addr")
    assert str(info.value).startswith("--master_addr")


def test_master_and_local_addr_checked_in_resolve(tmp_path, script):
    with pytest.raises(ConfigError, match="FTRUN_MASTER_ADDR '300.0.0.1' is not a valid IPv4"):
        res(tmp_path, script, environ={"FTRUN_MASTER_ADDR": "300.0.0.1"})
    with pytest.raises(ConfigError, match="--local_addr"):
        res(tmp_path, script, {"local_addr": "1.2.3.400"})
    spec = res(tmp_path, script, {"master_addr": "[::1]", "local_addr": "localhost"})
    assert spec.master_addr == "::1" and spec.local_addr == "localhost"


# --------------------------------------------------------------------------- checkpoint directory, FTRUN_FAULT


def test_checkpoint_dir_created_and_checked_when_ttp_on(tmp_path, script):
    spec = res(tmp_path, script, {"checkpoint_dir": "ck/sub"})
    assert (tmp_path / "ck" / "sub").is_dir() and list((tmp_path / "ck" / "sub").iterdir()) == []
    assert spec.checkpoint_dir == "ck/sub"
    write(tmp_path / "afile", "x")
    with pytest.raises(ConfigError, match="--checkpoint_dir afile is a file, not a directory"):
        res(tmp_path, script, {"checkpoint_dir": "afile"})
    with pytest.raises(ConfigError, match="cannot create FTRUN_CHECKPOINT_DIR .*afile/x: Not a directory"):
        res(tmp_path, script, environ={"FTRUN_CHECKPOINT_DIR": str(tmp_path / "afile" / "x")})
    with pytest.raises(ConfigError, match="cannot create --checkpoint_dir /proc/ftrun-test-ckpt"):
        res(tmp_path, script, {"checkpoint_dir": "/proc/ftrun-test-ckpt"})
    with pytest.raises(ConfigError, match="--checkpoint_dir is empty"):
        res(tmp_path, script, {"checkpoint_dir": " "})
    # TTP off: nothing is written there, so nothing is checked
    assert res(tmp_path, script, {"checkpoint_dir": "afile", "tft": "{HCCE:1}"}).checkpoint_dir == "afile"


def test_checkpoint_dir_not_writable(tmp_path, script, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match="cannot write to --checkpoint_dir ro: Permission denied"):
        res(tmp_path, script, {"checkpoint_dir": "ro"})


@pytest.mark.parametrize(
    "fault, hint",
    [
        ("rank=x", "rank='x' is not an integer"),
        ("rank=0,kind=boom", "unknown kind 'boom'"),
        ("rank=0,point=nowhere", "unknown point 'nowhere'"),
        ("rank=0,whence=3", "unknown key 'whence'"),
        ("step=3", "names no rank"),
        ("rank=0,step=", "step='' is not an integer"),
        ("rank=0,step=1.5", "step='1.5' is not an integer"),
        ("rank=-1", "rank=-1 is out of range"),
        ("rank=0,kind=exit,code=300", "code=300 is out of range"),
        ("rank=0,code=3", "code= applies to kind=exit only"),
        ("rank=0,rank=1", "rank is given twice"),
        ("rank=0 step=3", "rank='0 step=3' is not an integer"),
        ("rank=4,step=3", "names rank 4, but the job has ranks 0..3"),
        ("rank=0,step=3; rank=1,kind=oops", "unknown kind 'oops'"),
        ("rank=0,point=allreduce,nth=2", "nth= needs step="),
        ("rank=0,step=3,nth=0", "nth=0 is out of range (at least 1)"),
        ("rank=0,step=3,nth=two", "nth='two' is not an integer"),
        ("rank=0,step=3,nth=1,nth=2", "nth is given twice"),
    ],
)
def test_ftrun_fault_checked_before_launch(tmp_path, script, fault, hint):
    with pytest.raises(ConfigError) as info:
        res(tmp_path, script, {"worker_num": "4"}, environ={"FTRUN_FAULT": fault})
    message = str(info.value)
    assert hint in message and "fix or unset FTRUN_FAULT" in message and "\n" not in message


def test_ftrun_fault_valid_values_pass(tmp_path, script):
    for fault in ("rank=2,step=50,point=allreduce,kind=kill", "rank=0,step=20,kind=kill; rank=3,step=40,point=optimizer,"
                  "kind=exit,code=7", "rank=1,point=rejoin,incarnation=1,kind=kill", "  ", "rank=0,point=init,kind=exit"):
        res(tmp_path, script, {"worker_num": "4"}, environ={"FTRUN_FAULT": fault})
    assert parse_faults("rank=3,step=9,point=optimizer,kind=recoverable")[0].kind == "recoverable"
    res(tmp_path, script, {"worker_num": "4"}, environ={"FTRUN_FAULT": "rank=1,step=8,point=allreduce,nth=3,kind=kill"})
    assert parse_faults("rank=1,step=8,point=allreduce,nth=3")[0].nth == 3
    assert parse_faults("rank=1,step=8,point=allreduce")[0].nth is None  # the first time it matches


def test_ftrun_fault_nth_fires_at_the_kth_visit_of_the_point_at_that_step():
    from ftrun.common.faults import FaultInjector, InjectedFault

    faults = parse_faults("rank=1,step=5,point=allreduce,nth=3,kind=exception; rank=1,step=5,point=optimizer,kind=exception")
    injector = FaultInjector(faults, rank=1, incarnation=0, attempt=0)
    for _ in range(3):
        injector.point("allreduce", 4)  # another step: counted apart
    injector.point("allreduce", 5)
    injector.point("allreduce", 5)
    assert injector.counts(5) == {"allreduce": 2} and injector.counts(4) == {"allreduce": 3}
    with pytest.raises(InjectedFault, match="at allreduce, step 5"):
        injector.point("allreduce", 5)  # the third all-reduce of step 5 (a third backward pass)
    injector.point("allreduce", 5)  # a retried step counts on; the fault fired once
    assert injector.counts(5) == {"allreduce": 4}
    with pytest.raises(InjectedFault, match="at optimizer, step 5"):
        injector.point("optimizer", 5)  # without nth: the first time it matches
    injector.point("optimizer", 5)
    assert injector.counts(5) == {"allreduce": 4, "optimizer": 2} and injector.counts(6) == {}
    injector.point("init", None)  # a point of no step is not counted
    # Only the newest steps' counts are kept: memory does not grow with the run.
    for step in range(6, 1006):
        injector.point("before_forward", step)
    kept = [step for step in range(1006) if injector.counts(step)]
    assert kept == list(range(1006 - FaultInjector.KEEP_STEPS, 1006)) and injector.counts(1005) == {"before_forward": 1}


# --------------------------------------------------------------------------- torchrun's command line: parsers


@pytest.mark.parametrize("text, expected", [("1", (1, 1)), ("2:2", (2, 2)), ("1:4", (1, 4)), (" 3 ", (3, 3))])
def test_parse_nnodes(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text, hint", [("0", "at least 1"), ("x", "not a node count"), ("1:", "not a node count"),
                                        ("4:2", "MIN 4 is larger than MAX 2"), ("-1", "not a node count"),
                                        ("1:2:3", "not a node count"), ("99999999", "at most")])
def test_parse_nnodes_errors(text, hint):
    with pytest.raises(ConfigError, match=hint):
        parse_nnodes(text)


@pytest.mark.parametrize(
    "text, expected",
    [("node0", ("node0", 29400)), ("node0:1234", ("node0", 1234)), ("10.0.0.1:0", ("10.0.0.1", 0)),
     ("[::1]:29500", ("::1", 29500)), ("[::1]", ("::1", 29400)), ("fe80::1", ("fe80::1", 29400)),
     (" localhost:5 ", ("localhost", 5))],
)
def test_parse_rdzv_endpoint(text, expected):
    assert parse_rdzv_endpoint(text) == expected


@pytest.mark.parametrize("text, hint", [("", "names no host"), (":1234", "names no host"), ("h:x", "not a TCP port"),
                                        ("h:65536", "not a TCP port"), ("[::1:5", "unbalanced"), ("h:", "not a TCP port")])
def test_parse_rdzv_endpoint_errors(text, hint):
    with pytest.raises(ConfigError, match=hint):
        parse_rdzv_endpoint(text)


def test_parse_rdzv_conf():
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf("join_timeout=900, is_host = true,read_timeout=60") == {
        "join_timeout": 900.0, "is_host": True, "read_timeout": 60.0}
    assert parse_rdzv_conf("is_host=0,timeout=5,last_call_timeout=1,close_timeout=2") == {
        "is_host": False, "timeout": 5.0, "last_call_timeout": 1.0, "close_timeout": 2.0}


@pytest.mark.parametrize("text, hint", [("foo=1", "unknown key 'foo'"), ("join_timeout", "is not KEY=VALUE"),
                                        ("join_timeout=", "is not KEY=VALUE"), (",", "is not KEY=VALUE"),
                                        ("is_host=maybe", "must be 1 or 0"), ("join_timeout=1e15", "at most 604800"),
                                        ("timeout=nan", "timeout='nan'"), ("read_timeout=-1", "more than 0")])
def test_parse_rdzv_conf_errors(text, hint):
    with pytest.raises(ConfigError, match=hint):
        parse_rdzv_conf(text)


def test_parse_std_streams():
    assert parse_std_streams("3", "--tee", 2) == {0: 3, 1: 3}
    assert parse_std_streams("0:1,2:2", "--tee", 3) == {0: 1, 1: 0, 2: 2}
    for bad in ("4", "a", "0:4", "0:1,", "0=1"):
        with pytest.raises(ConfigError, match="--tee"):
            parse_std_streams(bad, "--tee", 2)
    with pytest.raises(ConfigError, match="not a local rank 0..1"):
        parse_std_streams("2:1", "-r", 2)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (TorchrunFlags(), None),  # torchrun's defaults: every rank prints to the console
        (TorchrunFlags(redirects="3"), ()),  # all redirected to files, nothing teed
        (TorchrunFlags(redirects="3", tee="3"), None),
        (TorchrunFlags(redirects="3", tee="0:3,2:1"), (0, 2)),
        (TorchrunFlags(redirects="1"), None),  # stderr still reaches the console
        (TorchrunFlags(redirects="0:3"), (1, 2, 3)),
        (TorchrunFlags(tee="3", local_ranks_filter="1,3"), (1, 3)),
        (TorchrunFlags(local_ranks_filter="0"), (0,)),
        (TorchrunFlags(local_ranks_filter=""), None),
    ],
)
def test_console_ranks(flags, expected):
    assert flags.console_ranks(4) == expected


# --------------------------------------------------------------------------- torchrun's command line: resolve


def test_nnodes_sets_the_world(tmp_path, script):
    spec = res(tmp_path, script, {"nnodes": "2", "local_worker_num": "4"}, environ=TOKEN_ENV)
    assert (spec.worker_num, spec.local_worker_num, spec.nnodes, spec.warnings) == (8, 4, 2, ())
    spec = res(tmp_path, script, {"nnodes": "2", "worker_num": "6"}, environ=TOKEN_ENV)
    assert (spec.worker_num, spec.local_worker_num, spec.nnodes) == (6, 3, 2)
    spec = res(tmp_path, script, {"nnodes": "3"}, environ=TOKEN_ENV)
    assert (spec.worker_num, spec.local_worker_num) == (3, 1)  # torchrun's --nproc-per-node defaults to 1
    spec = res(tmp_path, script, {"nnodes": "1:1", "local_worker_num": "4"})
    assert (spec.worker_num, spec.local_worker_num, spec.nnodes) == (4, 4, 1)
    spec = res(tmp_path, script, environ={"FTRUN_NNODES": "2", "FTRUN_LOCAL_WORKER_NUM": "2", **TOKEN_ENV})
    assert spec.worker_num == 4 and spec.nnodes == 2


def test_nnodes_range_is_max_nodes_ranks_going_on_with_min(tmp_path, script):
    spec = res(tmp_path, script, {"nnodes": "1:4", "local_worker_num": "2"}, environ=TOKEN_ENV)
    assert (spec.worker_num, spec.nnodes, spec.min_nodes) == (8, 4, 1)
    assert spec.warnings == ("--nnodes 1:4: the world keeps 4 nodes' ranks (torchrun would resize it); with 1 to 4 "
                             "nodes present, an absent node's ranks run on the others until it joins (ARF)",)
    fixed = res(tmp_path, script, {"nnodes": "2", "local_worker_num": "2"}, environ=TOKEN_ENV)
    assert (fixed.nnodes, fixed.min_nodes) == (2, 2)


@pytest.mark.parametrize(
    "cli_values, hint",
    [
        ({"nnodes": "2", "local_worker_num": "2", "worker_num": "5"}, "--worker_num 5 disagrees with --nnodes 2 x "
                                                                       "--local_worker_num 2 = 4"),
        ({"nnodes": "2", "worker_num": "5"}, "cannot be split over --nnodes 2 nodes"),
        ({"nnodes": "2", "local_worker_num": "4096", "worker_num": "8192"}, None),
        ({"nnodes": "1048576", "local_worker_num": "2"}, "a job has at most 1048576"),
        ({"nnodes": "0"}, "--nnodes '0'"),
    ],
)
def test_nnodes_errors(tmp_path, script, cli_values, hint):
    if hint is None:
        assert res(tmp_path, script, cli_values, environ=TOKEN_ENV).nnodes == 2
        return
    with pytest.raises(ConfigError, match=hint):
        res(tmp_path, script, cli_values, environ=TOKEN_ENV)


def test_standalone(tmp_path, script):
    spec = res(tmp_path, script, {"local_worker_num": "4"}, environ={"FTRUN_MASTER_ADDR": "10.0.0.9"},
               torchrun=TorchrunFlags(standalone=True))
    assert (spec.master_addr, spec.master_port, spec.worker_num) == ("127.0.0.1", 0, 4)
    spec = res(tmp_path, script, {"master_port": "29501", "master_addr": "localhost"},
               torchrun=TorchrunFlags(standalone=True, rdzv_backend="c10d"))
    assert (spec.master_addr, spec.master_port) == ("localhost", 29501)
    for cli_values, flags, hint in [
        ({}, TorchrunFlags(standalone=True, rdzv_endpoint="h:1"), "drop --rdzv-endpoint"),
        ({"master_addr": "10.0.0.1"}, TorchrunFlags(standalone=True), "drop --master_addr 10.0.0.1"),
        ({"nnodes": "2"}, TorchrunFlags(standalone=True), "--standalone runs a single-node job"),
        ({"worker_num": "4", "local_worker_num": "2"}, TorchrunFlags(standalone=True), "make 2 nodes"),
    ]:
        with pytest.raises(ConfigError, match=hint):
            res(tmp_path, script, cli_values, environ=TOKEN_ENV, torchrun=flags)


def test_rdzv_endpoint_backend_and_conf(tmp_path, script):
    flags = TorchrunFlags(rdzv_backend="c10d", rdzv_endpoint="[::1]:29555", rdzv_conf="join_timeout=900,read_timeout=9")
    spec = res(tmp_path, script, {"run_id": "job-7"}, torchrun=flags)
    assert (spec.master_addr, spec.master_port, spec.cluster_time_out, spec.run_id) == ("::1", 29555, 900.0, "job-7")
    assert spec.warnings == ("--rdzv-conf read_timeout is ignored: ftrun's store has no separate read timeout",)
    spec = res(tmp_path, script, torchrun=TorchrunFlags(rdzv_backend="STATIC", rdzv_endpoint="localhost",
                                                        rdzv_conf="timeout=30"))
    assert (spec.master_addr, spec.master_port, spec.cluster_time_out) == ("localhost", 29400, 30.0)
    spec = res(tmp_path, script, {"master_addr": "127.0.0.1", "master_port": "29400"},
               torchrun=TorchrunFlags(rdzv_endpoint="127.0.0.1"))  # saying the same twice is fine
    assert spec.master_port == 29400
    # the endpoint is a flag: it beats the environment
    spec = res(tmp_path, script, environ={"FTRUN_MASTER_PORT": "1"}, torchrun=TorchrunFlags(rdzv_endpoint="::1"))
    assert spec.master_port == 29400


@pytest.mark.parametrize(
    "cli_values, flags, hint",
    [
        ({}, TorchrunFlags(rdzv_backend="etcd-v2"), "--rdzv-backend 'etcd-v2' is not supported"),
        ({"master_addr": "10.0.0.2"}, TorchrunFlags(rdzv_endpoint="10.0.0.1:5"), "name different hosts"),
        ({"master_port": "6"}, TorchrunFlags(rdzv_endpoint="10.0.0.1:5"), "master_port 5, but --master_port gives 6"),
        ({"cluster_time_out": "6"}, TorchrunFlags(rdzv_conf="join_timeout=5"), "cluster_time_out 5"),
        ({}, TorchrunFlags(rdzv_endpoint="999.1.1.1:5"), "--rdzv-endpoint '999.1.1.1' is not a valid IPv4"),
        ({"nnodes": "2", "node_rank": "1"}, TorchrunFlags(rdzv_conf="is_host=1"), "is_host=1 makes this node 0"),
        ({"nnodes": "2"}, TorchrunFlags(rdzv_conf="is_host=0"), "give its --node_rank"),
        ({}, TorchrunFlags(tee="0:3", local_ranks_filter="x"), "--local-ranks-filter"),
        ({"tail_worker_log": "0"}, TorchrunFlags(redirects="3"), "give one of them"),
        ({"run_id": "has space"}, TorchrunFlags(), "printable characters without spaces"),
        ({"run_id": "x" * 257}, TorchrunFlags(), "1 to 256"),
    ],
)
def test_torchrun_errors(tmp_path, script, cli_values, flags, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        res(tmp_path, script, cli_values, environ=TOKEN_ENV, torchrun=flags)
    assert "\n" not in str(info.value)


def test_multi_node_with_c10d_and_node_rank_or_is_host(tmp_path, script):
    flags = TorchrunFlags(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400")
    assert res(tmp_path, script, {"nnodes": "2", "node_rank": "1"}, environ=TOKEN_ENV, torchrun=flags).node_rank == 1
    flags = TorchrunFlags(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400", rdzv_conf="is_host=1")
    spec = res(tmp_path, script, {"nnodes": "2"}, environ=TOKEN_ENV, torchrun=flags)
    assert (spec.node_rank, spec.node_rank_auto) == (0, False)
    # Neither: the node index is decided at start (torchrun's dynamic rendezvous).
    flags = TorchrunFlags(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400")
    spec = res(tmp_path, script, {"nnodes": "2"}, environ=TOKEN_ENV, torchrun=flags)
    assert (spec.node_rank, spec.node_rank_auto) == (0, True)


def test_tee_chooses_console_ranks_over_env(tmp_path, script):
    spec = res(tmp_path, script, {"local_worker_num": "4"}, environ={"FTRUN_TAIL_WORKER_LOG": "1"},
               torchrun=TorchrunFlags(redirects="3", tee="0:3"))
    assert spec.tail_worker_log == (0,)


# --------------------------------------------------------------------------- the job's secret


def test_token_single_node_optional(tmp_path, script):
    spec = res(tmp_path, script)
    assert read_job_token(spec, {}) is None
    assert read_job_token(spec, {"FTRUN_TOKEN": "  " + TOKEN + "\n"}) == TOKEN


def test_token_multi_node_required(tmp_path, script):
    with pytest.raises(ConfigError) as info:
        res(tmp_path, script, {"worker_num": "4", "local_worker_num": "2"})
    assert str(info.value) == (
        "a multi-node job needs a shared secret: set FTRUN_TOKEN (the same value on every node) or --token_file "
        "FILE; e.g. FTRUN_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')"
    )
    spec = JobSpec(script="x.py", worker_num=4, local_worker_num=2)
    with pytest.raises(ConfigError, match="needs a shared secret"):
        read_job_token(spec, {})


def test_token_file(tmp_path, script):
    write(tmp_path / "tok", f"\n  {TOKEN}  \n")
    spec = res(tmp_path, script, {"nnodes": "2", "token_file": "tok"})
    assert spec.token_file == str(tmp_path / "tok")  # made absolute
    assert read_job_token(spec, {}) == TOKEN
    spec = res(tmp_path, script, {"nnodes": "2"}, environ={"FTRUN_TOKEN_FILE": str(tmp_path / "tok")})
    assert read_job_token(spec, {}) == TOKEN


SECRET = "s3cr3t-value"


@pytest.mark.parametrize(
    "content, environ, hint",
    [
        (None, {}, "cannot read --token_file .*: No such file or directory"),
        ("", {}, "is empty"),
        ("   \n", {}, "is empty"),
        (SECRET, {}, "is 12 characters long; the job's secret must be at least 16"),
        (SECRET + " and more words", {}, "holds spaces"),
        (SECRET + "é" * 10, {}, "printable ASCII"),
        (b"\xff\xfe" + b"x" * 20, {}, "is not text"),
        ("x" * 5000, {}, "larger than 4096 bytes"),
        ("x" * 20, {"FTRUN_TOKEN": "y" * 20}, "both set"),
    ],
)
def test_token_file_errors(tmp_path, script, content, environ, hint):
    path = tmp_path / "tok"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=hint) as info:
        res(tmp_path, script, {"nnodes": "2", "token_file": str(path)}, environ=environ)
    assert SECRET not in str(info.value)  # the secret is never printed


@pytest.mark.parametrize("value, hint", [("", "FTRUN_TOKEN is empty"), ("short", "is 5 characters long"),
                                         (SECRET + " " + SECRET, "holds spaces")])
def test_env_token_errors(tmp_path, script, value, hint):
    with pytest.raises(ConfigError, match=hint) as info:
        res(tmp_path, script, {"nnodes": "2"}, environ={"FTRUN_TOKEN": value})
    assert SECRET not in str(info.value)


def test_token_file_is_a_directory(tmp_path, script):
    with pytest.raises(ConfigError, match="--token_file .* is a directory; give a regular file"):
        res(tmp_path, script, {"token_file": str(tmp_path)})


def test_token_file_is_a_fifo_and_nothing_blocks(tmp_path, script):
    """A FIFO would block a plain read forever (round 3): it is refused before any read."""
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="--token_file .* is a FIFO; give a regular file"):
        res(tmp_path, script, {"token_file": str(fifo)})
    with pytest.raises(ConfigError, match="--token_file is empty"):
        res(tmp_path, script, {"token_file": " "})


def test_jobspec_json_round_trip_new_fields(tmp_path, script):
    write(tmp_path / "tok", TOKEN)
    spec = res(tmp_path, script, {"nnodes": "1:2", "run_id": "r1", "local_addr": "127.0.0.1", "token_file": "tok"})
    assert spec.warnings and spec.run_id == "r1" and spec.local_addr == "127.0.0.1"
    data = json.loads(json.dumps(spec.to_json()))
    assert JobSpec.from_json(data) == spec and data["warnings"] == list(spec.warnings)
    old = {k: v for k, v in data.items() if k not in ("run_id", "local_addr", "token_file", "warnings")}
    assert JobSpec.from_json(old).warnings == ()  # a spec from an older writer still loads


def test_role_on_every_layer_and_in_the_spec_json(tmp_path, script):
    """torchrun's --role is an option like the others: flag, FTRUN_ROLE, TOML; default 'default'."""
    assert res(tmp_path, script).role == "default"
    assert res(tmp_path, script, {"role": " trainer "}).role == "trainer"
    assert res(tmp_path, script, environ={"FTRUN_ROLE": "reader"}).role == "reader"
    config = write(tmp_path / "cfg.toml", 'role = "evaluator"\n')
    assert res(tmp_path, script, config_file=config).role == "evaluator"
    assert res(tmp_path, script, {"role": "trainer"}, environ={"FTRUN_ROLE": "reader"}).role == "trainer"
    spec = res(tmp_path, script, {"role": "trainer"})
    assert JobSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ConfigError, match="^FTRUN_ROLE 'x y' must be 1 to 256 printable characters without spaces"):
        res(tmp_path, script, environ={"FTRUN_ROLE": "x y"})


def test_nnodes_is_computed_and_kept_consistent():
    """nnodes is an option (--nnodes) the spec computes: worker_num / local_worker_num, also
    after dataclasses.replace and a JSON round trip."""
    spec = JobSpec(script="x.py", worker_num=8, local_worker_num=2)
    assert spec.nnodes == 4
    assert dataclasses.replace(spec, worker_num=4).nnodes == 2
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(TypeError):
        JobSpec(script="x.py", nnodes=3)  # computed, never given


# --------------------------------------------------------------------------- torchrun's command line, in process


def test_cli_torchrun_single_node_command_line(cli_spec, script):
    spec = cli_spec("--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=0", "--monitor-interval=0.5",
                    "--rdzv-id", "exp1", "-r", "3", "-t", "0:3", "--log-dir", "L", "--run-path", script, "--lr", "1")
    assert (spec.worker_num, spec.local_worker_num, spec.master_addr, spec.master_port) == (4, 4, "127.0.0.1", 0)
    assert spec.max_restarts == 0 and spec.monitor_interval == 0.5 and spec.run_id == "exp1" and spec.log_dir == "L"
    assert spec.tail_worker_log == (0,) and spec.script == script and spec.script_args == ("--lr", "1")
    assert not spec.module and not spec.no_python


def test_cli_torchrun_multi_node_command_line(cli_spec, monkeypatch, script):
    monkeypatch.setenv("FTRUN_TOKEN", TOKEN)
    spec = cli_spec("--nnodes", "2", "--nproc_per_node", "2", "--node_rank", "1", "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", "localhost:29411", "--rdzv_conf", "join_timeout=120", "--local_addr", "127.0.0.1",
                    "--shutdown-timeout", "9", "--local-ranks-filter", "1", script)
    assert (spec.worker_num, spec.local_worker_num, spec.node_rank, spec.nnodes) == (4, 2, 1, 2)
    assert (spec.master_addr, spec.master_port, spec.cluster_time_out) == ("localhost", 29411, 120.0)
    assert spec.local_addr == "127.0.0.1" and spec.grace_period == 9.0 and spec.tail_worker_log == (1,)
    monkeypatch.delenv("FTRUN_TOKEN")
    token_file = Path(script).parent / "token"
    token_file.write_text(TOKEN)
    spec = cli_spec("--master-addr", "127.0.0.1", "--master-port", "29412", "--node-rank", "0", "--nnodes", "2",
                    "--rdzv-backend", "static", "--token-file", str(token_file), script)
    assert (spec.master_port, spec.nnodes) == (29412, 2)


def test_cli_nproc_per_node_cpu(cli_spec, script):
    import os

    assert cli_spec("--nproc-per-node", "cpu", script).local_worker_num == (os.cpu_count() or 1)


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--start_method=fork"], "--start-method fork is refused: fork would copy the launcher's state"),
        (["--start-method", "forkserver", "--fork_server", "off"], "--start-method forkserver means --fork_server on"),
        (["--start-method", "threads"], "--start-method 'threads' is not one of torchrun's spawn, fork, forkserver"),
        (["--role", "a b"], "--role 'a b' must be 1 to 256 printable characters without spaces"),
        (["--event-log-handler", "x"], "--event-log-handler"),
        (["--signals-to-handle", "SIGUSR1"], "--signals-to-handle"),
        (["--virtual-local-rank"], "--virtual-local-rank"),
        (["--duplicate_stdout_filters", "a"], "--duplicate_stdout_filters"),
        (["--no-such-flag"], "No such option: --no-such-flag"),
        (["--nproc_per_node", "2", "--local_worker_num", "3"], "disagree"),
        (["--nproc_per_node", "tpu"], "--nproc_per_node 'tpu': give a number of ranks, or one of auto, cpu, gpu, xpu"),
        (["--rdzv-id", "a", "--run-id", "b"], "--rdzv-id a and --run_id b disagree"),
        (["--run-path", "--no-python"], "--run-path"),
    ],
)
def test_cli_refusals(tmp_path, monkeypatch, script, capsys, argv, hint):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        ftrun.cli.main([*argv, script])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ftrun: error: ") and hint in err and err.count("\n") == 1, err


def test_the_default_port_of_a_single_node_job_falls_back_to_a_free_one(tmp_path, script):
    """Two single-node jobs started with default flags on one machine. The second
    takes a free port, as torchrun does; a port given anywhere is kept (and refused when taken)."""
    import socket

    from ftrun.node.launcher import host_store

    assert res(tmp_path, script).master_port_auto
    assert not res(tmp_path, script, {"master_port": "29500"}).master_port_auto
    assert not res(tmp_path, script, environ={"FTRUN_MASTER_PORT": "29500"}).master_port_auto
    assert not res(tmp_path, script, {"worker_num": "4", "local_worker_num": "2"},
                   environ={"FTRUN_TOKEN": SECRET * 2}).master_port_auto
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = dataclasses.replace(res(tmp_path, script), master_port=port)
        store, used, _, _ = host_store(spec)
        assert used != port and used > 0
        del store
        with pytest.raises(ConfigError, match=f"--master_port {port} is already in use"):
            host_store(dataclasses.replace(spec, master_port_auto=False))

"""Unit tests of ftrun.config, ftrun.policy and ftrun.protocol (no processes, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ftrun.cli
import ftrun.launcher
from ftrun.config import (
    OPTIONS,
    ConfigError,
    JobSpec,
    TftSwitches,
    parse_tail,
    parse_tft,
    read_toml,
    resolve,
)
from ftrun.policy import (
    INITIAL,
    NO_STATE,
    Action,
    NoLiveReplica,
    RecoveryPlan,
    Transfer,
    decide_on_failure,
    default_replica_groups,
    plan_recovery,
    replica_groups_from_hello,
)

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def cli(**values):
    """CLI values as the CLI passes them: every option present, None where not given."""
    out = {opt.name: None for opt in OPTIONS}
    out.update(values)
    return out


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def res(tmp_path: Path, script: str, cli_values=None, environ=None, config_file=None, **kw) -> JobSpec:
    return resolve(
        cli(**(cli_values or {})),
        script=script,
        environ=environ or {},
        cwd=tmp_path,
        config_file=None if config_file is None else str(config_file),
        **kw,
    )


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
    spec = res(tmp_path, script, config_file=config)
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
        ({"node_rank": "-1"}, {}, "--node_rank -1"),
        ({"master_port": "65536"}, {}, "not a TCP port"),
        ({"master_port": "-1"}, {}, "not a TCP port"),
        ({"worker_num": "4", "local_worker_num": "2", "master_port": "0"}, {}, "one node only"),
        ({"max_restarts": "-1"}, {}, "--max_restarts must be >= 0"),
        ({"grace_period": "-0.5"}, {}, "--grace_period"),
        ({"monitor_interval": "0"}, {}, "--monitor_interval must be a positive"),
        ({"cluster_time_out": "-1"}, {}, "--cluster_time_out must be a positive"),
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
    with pytest.raises(ConfigError, match="--worker_num must be at least 1"):
        res(tmp_path, script, environ={"FTRUN_WORKER_NUM": "0"})
    with pytest.raises(ConfigError, match="larger than"):
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
    with pytest.raises(ConfigError, match="key worker_num: 'many' is not valid"):
        res(tmp_path, script, config_file=config)
    config = write(tmp_path / "cfg2.toml", "worker_num = true\n")
    with pytest.raises(ConfigError, match="must be an integer"):
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
    """Stands in for ftrun.launcher.Launcher: records the spec, runs nothing."""

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
    monkeypatch.setattr(ftrun.launcher, "Launcher", FakeLauncher)
    FakeLauncher.specs = []

    def run(*argv: str) -> JobSpec:
        with pytest.raises(SystemExit) as info:
            ftrun.cli.main(["--plain", *argv])
        assert info.value.code == 0
        return FakeLauncher.specs[-1]

    return run


def test_cli_hyphenated_flags(cli_spec, script):
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
    # Two nodes of 2 ranks: the world size comes from the environment, the node's share from the CLI.
    monkeypatch.setenv("FTRUN_WORKER_NUM", "4")
    spec = cli_spec(flag, "2", "--master_port", "1234", script)
    assert spec.worker_num == 4 and spec.local_worker_num == 2 and spec.nnodes == 2


def test_cli_local_worker_num_keeps_worker_num_from_config(cli_spec, tmp_path, script):
    config = write(tmp_path / "cfg.toml", "worker_num = 4\n")
    spec = cli_spec("--config", str(config), "--local_worker_num", "2", "--master_port", "1234", script)
    assert spec.worker_num == 4 and spec.local_worker_num == 2


def test_cli_nproc_per_node_conflict(tmp_path, monkeypatch, script, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        ftrun.cli.main(["--nproc_per_node", "2", "--local_worker_num", "3", script])
    assert info.value.code == 2
    assert "disagree" in capsys.readouterr().err


# --------------------------------------------------------------------------- policy: decide_on_failure


def decide(failed, *, world=4, arf=True, library=None, used=0, max_restarts=3, single_node=True):
    return decide_on_failure(
        failed,
        world_size=world,
        arf=arf,
        library_ranks=range(world) if library is None else library,
        restarts_used=used,
        max_restarts=max_restarts,
        single_node=single_node,
    )


def test_arf_when_all_ranks_use_library_on_one_node():
    d = decide([2, 1, 2])
    assert d.action == Action.RESPAWN_RANKS and d.ranks == (1, 2)


def test_restart_job_when_a_rank_lacks_the_library():
    d = decide([1], library=[0, 1, 2])
    assert d.action == Action.RESTART_JOB and d.ranks == (1,)
    assert "3" in d.reason and "library" in d.reason


def test_restart_job_when_no_rank_uses_the_library():
    d = decide([0], library=[])
    assert d.action == Action.RESTART_JOB and "0-3" in d.reason


def test_restart_job_when_multi_node():
    d = decide([1], single_node=False)
    assert d.action == Action.RESTART_JOB and "one node" in d.reason


def test_restart_job_when_arf_off():
    d = decide([1], arf=False)
    assert d.action == Action.RESTART_JOB and "ARF is off" in d.reason


def test_budget_exhausted_whole_job():
    assert decide([1], arf=False, used=2, max_restarts=3).action == Action.RESTART_JOB
    d = decide([1], arf=False, used=3, max_restarts=3)
    assert d.action == Action.FAIL_JOB and "max_restarts=3" in d.reason
    assert decide([0], arf=False, max_restarts=0).action == Action.FAIL_JOB


def test_arf_cost_is_number_of_failed_ranks():
    assert decide([0, 1], used=1, max_restarts=3).action == Action.RESPAWN_RANKS  # 1 + 2 <= 3
    d = decide([0, 1], used=2, max_restarts=3)  # 2 + 2 > 3
    assert d.action == Action.FAIL_JOB and d.ranks == (0, 1) and "2 more needed" in d.reason
    # A whole-job restart would cost only one: it is still possible without the library.
    assert decide([0, 1], used=2, max_restarts=3, library=[]).action == Action.RESTART_JOB
    assert decide([0, 1, 2], max_restarts=2).action == Action.FAIL_JOB


def test_decide_needs_a_failed_rank():
    with pytest.raises(ValueError):
        decide([])


# --------------------------------------------------------------------------- policy: plan_recovery


def pairs(plan: RecoveryPlan) -> list[tuple[int, int]]:
    return sorted((t.donor, t.recipient) for t in plan.transfers)


def test_plan_single_respawned_rank():
    plan = plan_recovery({0: 10, 1: NO_STATE, 2: 10, 3: 10}, default_replica_groups(4))
    assert plan.step == 10
    assert plan.recipients == {1}
    assert plan.donors <= {0, 2, 3}
    assert pairs(plan) == [(0, 1)]


def test_plan_step_is_newest_committed_and_laggards_receive():
    # The newest step committed by a live replica is S; a survivor whose update for S did not run (9)
    # and a respawned rank (-1) receive it.
    plan = plan_recovery({0: 10, 1: 9, 2: NO_STATE, 3: 10}, [[0, 1, 2, 3]])
    assert plan.step == 10 and plan.recipients == {1, 2} and plan.donors <= {0, 3}


def test_plan_donors_round_robin():
    plan = plan_recovery({0: 5, 1: 5, 2: NO_STATE, 3: NO_STATE, 4: NO_STATE, 5: 4}, [[0, 1, 2, 3, 4, 5]])
    assert plan.step == 5
    assert pairs(plan) == [(0, 2), (0, 4), (1, 3), (1, 5)]


def test_plan_nothing_to_do():
    plan = plan_recovery({0: 3, 1: 3}, [[0, 1]])
    assert plan == RecoveryPlan(step=3, transfers=())


def test_plan_dead_ranks_are_neither_donors_nor_recipients():
    plan = plan_recovery({0: 7, 2: NO_STATE}, [[0, 1, 2, 3]])
    assert plan.step == 7 and pairs(plan) == [(0, 2)]


def test_plan_dp_x_tp_groups():
    # DP=2 x TP=2: replica groups are the ranks with the same TP coordinate.
    groups = [[0, 2], [1, 3]]
    plan = plan_recovery({0: 8, 1: 8, 2: NO_STATE, 3: 8}, groups)
    assert plan.step == 8 and pairs(plan) == [(0, 2)]
    plan = plan_recovery({0: NO_STATE, 1: 8, 2: 8, 3: NO_STATE}, groups)
    assert plan.step == 8 and pairs(plan) == [(1, 3), (2, 0)]
    assert all(
        any(t.donor in g and t.recipient in g for g in groups) for t in plan.transfers
    ), "a transfer crossed replica groups"


def test_plan_step_is_oldest_newest_across_groups():
    # Group [0,2] reached step 9 on rank 0, rank 2 holds 8; group [1,3] only 8: all shards resume at 8.
    plan = plan_recovery({0: 9, 1: 8, 2: 8, 3: NO_STATE}, [[0, 2], [1, 3]])
    assert plan.step == 8
    assert pairs(plan) == [(1, 3), (2, 0)]


def test_plan_no_live_replica():
    with pytest.raises(NoLiveReplica, match="0,2"):
        plan_recovery({0: NO_STATE, 1: 5, 2: NO_STATE, 3: 5}, [[0, 2], [1, 3]])
    with pytest.raises(NoLiveReplica):
        plan_recovery({1: 5, 3: 5}, [[0, 2], [1, 3]])  # group [0,2] entirely dead
    with pytest.raises(NoLiveReplica):
        plan_recovery({0: NO_STATE, 1: NO_STATE}, [[0, 1]])


def test_plan_before_the_first_step():
    # Nothing committed yet: ranks holding the broadcast initial state give it to those without.
    plan = plan_recovery({0: INITIAL, 1: NO_STATE, 2: INITIAL, 3: NO_STATE}, [[0, 1, 2, 3]])
    assert plan.step == INITIAL and pairs(plan) == [(0, 1), (2, 3)]
    with pytest.raises(NoLiveReplica):
        plan_recovery({0: NO_STATE, 1: NO_STATE}, [[0, 1]])  # rank 0 died before its broadcast


def test_plan_shards_diverged():
    # Group [0,2] only has step 9, group [1,3] only step 8: no step every group can provide.
    with pytest.raises(NoLiveReplica, match="diverged"):
        plan_recovery({0: 9, 1: 8, 2: 9, 3: 8}, [[0, 2], [1, 3]])


def test_transfer_and_plan_properties():
    plan = RecoveryPlan(step=1, transfers=(Transfer(0, 1), Transfer(0, 2)))
    assert plan.recipients == {1, 2} and plan.donors == {0}


# --------------------------------------------------------------------------- policy: replica groups


def test_replica_groups_default_and_undeclared():
    assert default_replica_groups(3) == [[0, 1, 2]]
    assert replica_groups_from_hello(3, {}) == [[0, 1, 2]]


def test_replica_groups_dp_x_tp():
    declared = {0: [2, 0], 1: [1, 3], 2: [0, 2], 3: [3, 1]}
    assert replica_groups_from_hello(4, declared) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "world, declared, hint",
    [
        (3, {0: [1, 2], 1: [1, 2], 2: [1, 2]}, "without itself"),
        (3, {0: [0, 1], 1: [1, 2], 2: [1, 2]}, "overlap"),
        (4, {0: [0, 1], 1: [0, 1]}, "overlap"),  # ranks 2, 3 undeclared: their default group overlaps
        (4, {0: [0, 5], 1: [1], 2: [2], 3: [3]}, "cover"),  # a rank outside the job
    ],
)
def test_replica_groups_invalid(world, declared, hint):
    with pytest.raises(ValueError, match=hint):
        replica_groups_from_hello(world, declared)

"""Cluster environments (Slurm, Kubeflow PyTorchJob) and the automatic node index in the
configuration: Slurm's compressed host lists, precedence (flags, FTRUN_*, TOML over the cluster's
variables), labels naming the variable, and ``JobSpec.node_rank_auto`` (no processes, fast)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ftrun.config import (
    OPTIONS,
    ConfigError,
    JobSpec,
    TorchrunFlags,
    expand_hostlist,
    first_host,
    read_cluster_env,
    resolve,
)

TOKEN_ENV = {"FTRUN_TOKEN": "0123456789abcdef0123"}
SLURM = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "127.0.0.[1-4]"}
PET = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "23456",
       "PET_NPROC_PER_NODE": "2"}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def res(tmp_path: Path, script: str, cli_values=None, environ=None, **kw) -> JobSpec:
    cli = {opt.name: None for opt in OPTIONS}
    cli.update(cli_values or {})
    return resolve(cli, script=script, environ={**TOKEN_ENV, **(environ or {})}, cwd=tmp_path, **kw)


# --------------------------------------------------------------------------- Slurm host lists


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-[001-002]-x", ["gpu-001-x", "gpu-002-x"]),
        ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: the low end has one digit
        ("n[08-10]", ["n08", "n09", "n10"]),  # padding kept
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[0001-0002]", ["n0001", "n0002"]),
        ("n[7]", ["n7"]),
        ("n[3-3]", ["n3"]),
        ("n[1,3,5-6]", ["n1", "n3", "n5", "n6"]),
        ("n[2,1]", ["n2", "n1"]),  # order as written
        ("x", ["x"]),
        ("  x  ", ["x"]),
        ("a,b,c", ["a", "b", "c"]),
        ("a[1-2],b,c[01-02]", ["a1", "a2", "b", "c01", "c02"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several groups: the last one fastest
        ("host-1.example.com", ["host-1.example.com"]),
        ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ("[1-2]x", ["1x", "2x"]),
        ("n[ 1 - 2 ]".replace(" - ", "-"), ["n1", "n2"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize(
    "text, hint",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("node[01-", "'[' without ']'"),
        ("node01]", "']' without '['"),
        ("node[[1]]", "nested brackets"),
        ("node[]", "empty brackets"),
        ("node[ ]", "empty brackets"),
        ("node[a-b]", "'a-b' in 'node[a-b]' is not a number or a range"),
        ("node[1-2-3]", "is not a number or a range"),
        ("node[1,,2]", "is not a number or a range"),
        ("node[-2]", "is not a number or a range"),
        ("node[3-1]", "runs backwards"),
        ("a,,b", "empty host name"),
        (",a", "empty host name"),
        ("a,", "empty host name"),
    ],
)
def test_expand_hostlist_errors(text, hint):
    with pytest.raises(ConfigError, match="^SLURM_JOB_NODELIST") as info:
        expand_hostlist(text)
    assert hint in str(info.value)
    assert "\n" not in str(info.value)


def test_first_host_expands_nothing_ahead():
    start = time.monotonic()
    assert first_host("node[00000000-99999999],other") == "node00000000"
    assert time.monotonic() - start < 0.5
    with pytest.raises(ConfigError, match="more than 3 hosts"):
        expand_hostlist("n[1-4]", limit=3)
    assert expand_hostlist("n[1-3]", limit=3) == ["n1", "n2", "n3"]


def test_first_host_checks_brackets_everywhere_and_ranges_up_to_the_first_host():
    with pytest.raises(ConfigError, match="'\\[' without '\\]'"):
        first_host("good,bad[")
    assert first_host("good,bad[3-1]") == "good"  # nothing after the first host is expanded
    with pytest.raises(ConfigError, match="runs backwards"):
        expand_hostlist("good,bad[3-1]")


# --------------------------------------------------------------------------- reading the environment


def test_no_cluster_environment():
    env = read_cluster_env({"PATH": "/bin", "HOME": "/root"})
    assert (env.name, env.values, env.labels, env.nodes) == ("", {}, {}, None)


def test_read_slurm():
    env = read_cluster_env(SLURM)
    assert env.name == "Slurm" and env.nodes == 4
    assert env.values == {"nnodes": "4", "node_rank": 2, "master_addr": "127.0.0.1"}
    assert env.labels["node_rank"] == "SLURM_NODEID (Slurm environment)"
    assert env.labels["nnodes"] == "SLURM_NNODES (Slurm environment)"
    assert env.labels["master_addr"] == "the first host of SLURM_JOB_NODELIST=127.0.0.[1-4] (Slurm environment)"


def test_read_slurm_older_names():
    env = read_cluster_env({"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "gpu-[007-008]"})
    assert env.values == {"nnodes": "2", "node_rank": 0, "master_addr": "gpu-007"}
    assert env.labels["master_addr"] == "the first host of SLURM_NODELIST=gpu-[007-008] (Slurm environment)"


def test_read_pytorchjob():
    env = read_cluster_env(PET)
    assert env.name == "PyTorchJob" and env.nodes == 2
    assert env.values == {"nnodes": "2", "node_rank": 1, "master_addr": "127.0.0.1", "master_port": 23456,
                          "local_worker_num": 2}
    assert env.labels["master_port"] == "PET_MASTER_PORT (PyTorchJob environment)"


def test_pytorchjob_wins_over_slurm():
    env = read_cluster_env({**SLURM, **PET})
    assert env.name == "PyTorchJob" and env.values["node_rank"] == 1


def test_pytorchjob_nproc_words_count_devices():
    env = read_cluster_env({"PET_NPROC_PER_NODE": "cpu"})
    assert env.values["local_worker_num"] == os.cpu_count()
    with pytest.raises(ConfigError, match=r"^PET_NPROC_PER_NODE=banana \(PyTorchJob environment\): "):
        read_cluster_env({"PET_NPROC_PER_NODE": "banana"})


@pytest.mark.parametrize(
    "environ, hint",
    [
        ({"SLURM_NNODES": "2", "SLURM_NODEID": "x"}, "SLURM_NODEID (Slurm environment): 'x' is not valid for node_rank"),
        ({"SLURM_NNODES": "2", "SLURM_NODEID": "-1"}, "SLURM_NODEID (Slurm environment) must be at least 0"),
        ({"PET_MASTER_PORT": "99999"}, "PET_MASTER_PORT (PyTorchJob environment) must be at least 0 and at most 65535"),
        ({"SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST=n[1- (Slurm environment) 'n[1-': '[' without ']'"),
    ],
)
def test_read_errors_name_the_variable(environ, hint):
    with pytest.raises(ConfigError) as info:
        read_cluster_env(environ)
    assert hint in str(info.value)


# --------------------------------------------------------------------------- resolve


def test_slurm_needs_no_flags(tmp_path, script):
    spec = res(tmp_path, script, environ=SLURM)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.node_rank_auto) == (4, 2, "127.0.0.1", False)
    assert spec.master_port == 29500 and spec.worker_num == 4  # one rank per node unless told
    spec = res(tmp_path, script, {"local_worker_num": "2"}, environ=SLURM)
    assert (spec.worker_num, spec.local_worker_num, spec.nnodes) == (8, 2, 4)


def test_pytorchjob_needs_no_flags(tmp_path, script):
    spec = res(tmp_path, script, environ=PET)
    assert (spec.worker_num, spec.local_worker_num, spec.node_rank, spec.master_addr, spec.master_port) == (
        4, 2, 1, "127.0.0.1", 23456)


def test_elastic_pytorchjob_runs_max_nodes(tmp_path, script):
    spec = res(tmp_path, script, environ={**PET, "PET_NNODES": "1:3"})
    assert (spec.nnodes, spec.min_nodes) == (3, 1)
    assert any(w.startswith("PET_NNODES (PyTorchJob environment) 1:3: the world keeps 3 nodes' ranks") for w in spec.warnings)


@pytest.mark.parametrize(
    "cli_values, environ, toml, node_rank",
    [
        ({"node_rank": "3"}, {}, "", 3),  # a flag wins
        ({}, {"FTRUN_NODE_RANK": "1"}, "", 1),  # FTRUN_* wins
        ({}, {}, "node_rank = 0\n", 0),  # TOML wins
        ({}, {}, "", 2),  # then Slurm's
    ],
)
def test_flags_env_and_toml_win_over_the_cluster(tmp_path, script, cli_values, environ, toml, node_rank):
    if toml:
        (tmp_path / "pyproject.toml").write_text("[tool.ftrun]\n" + toml)
    spec = res(tmp_path, script, cli_values, environ={**SLURM, **environ})
    assert spec.node_rank == node_rank and spec.nnodes == 4


def test_flags_win_over_each_cluster_value(tmp_path, script):
    spec = res(tmp_path, script, {"master_addr": "127.0.0.2", "master_port": "1234", "nnodes": "4",
                                  "local_worker_num": "3"}, environ=PET | {"PET_NNODES": "4"})
    assert (spec.master_addr, spec.master_port, spec.local_worker_num, spec.node_rank) == ("127.0.0.2", 1234, 3, 1)


@pytest.mark.parametrize(
    "environ, hint",
    [
        ({**SLURM, "SLURM_NODEID": "7"}, "SLURM_NODEID (Slurm environment) 7 is outside 0..3 for 4 node(s)"),
        ({**PET, "PET_NODE_RANK": "5"}, "PET_NODE_RANK (PyTorchJob environment) 5 is outside 0..1"),
        ({**SLURM, "SLURM_NNODES": "two"}, "SLURM_NNODES (Slurm environment) 'two' is not a node count"),
        ({**SLURM, "SLURM_JOB_NODELIST": "999.0.0.[1-2]"},
         "the first host of SLURM_JOB_NODELIST=999.0.0.[1-2] (Slurm environment) '999.0.0.1' is not a valid IPv4"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_NUM_NODES": "4"},
         "Slurm runs 16 tasks on 4 node(s) (SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES)"),
    ],
)
def test_resolve_errors_name_the_variable(tmp_path, script, environ, hint):
    with pytest.raises(ConfigError) as info:
        res(tmp_path, script, environ=environ)
    assert hint in str(info.value) and "\n" not in str(info.value)


def test_one_task_per_node_is_fine(tmp_path, script):
    spec = res(tmp_path, script, environ={**SLURM, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4"})
    assert spec.node_rank == 2


def test_single_node_cluster_job_keeps_the_store_on_loopback(tmp_path, script):
    spec = res(tmp_path, script, environ={"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"})
    assert (spec.nnodes, spec.node_rank, spec.master_addr) == (1, 0, "127.0.0.1")
    spec = res(tmp_path, script, environ={**PET, "PET_NNODES": "1", "PET_NODE_RANK": "0"})
    assert (spec.nnodes, spec.master_addr, spec.master_port) == (1, "127.0.0.1", 29500)


def test_a_replacement_step_of_another_size_decides_its_index_at_start(tmp_path, script):
    # A one-node Slurm step started to replace a node of a 3-node job: its SLURM_NODEID (0 in its
    # step) is not the job's; node 0 stays the first host of the job's node list.
    environ = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.[1-4]"}
    spec = res(tmp_path, script, {"nnodes": "3"}, environ=environ)
    assert (spec.nnodes, spec.node_rank, spec.node_rank_auto, spec.master_addr) == (3, 0, True, "127.0.0.1")
    assert any("SLURM_NODEID (Slurm environment) is not used" in w and "decided at start" in w for w in spec.warnings)
    # ... unless the index is given.
    spec = res(tmp_path, script, {"nnodes": "3", "node_rank": "2"}, environ=environ)
    assert (spec.node_rank, spec.node_rank_auto) == (2, False)


def test_node_rank_auto_only_when_no_index_anywhere(tmp_path, script):
    spec = res(tmp_path, script, {"nnodes": "2", "master_addr": "127.0.0.1"})
    assert (spec.node_rank, spec.node_rank_auto) == (0, True)
    assert not res(tmp_path, script, {"nnodes": "2", "node_rank": "0"}).node_rank_auto
    assert not res(tmp_path, script, {"nnodes": "2"}, environ={"FTRUN_NODE_RANK": "1"}).node_rank_auto
    assert not res(tmp_path, script, {"nnodes": "2"}, environ=SLURM | {"SLURM_NNODES": "2", "SLURM_NODEID": "1"}).node_rank_auto
    assert not res(tmp_path, script, {"nnodes": "2"}, torchrun=TorchrunFlags(rdzv_conf="is_host=1")).node_rank_auto
    assert not res(tmp_path, script).node_rank_auto  # one node: always node 0
    # torchrun's c10d rendezvous without --node_rank: no longer refused.
    flags = TorchrunFlags(rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400")
    assert res(tmp_path, script, {"nnodes": "2"}, torchrun=flags).node_rank_auto


def test_node_rank_auto_travels_in_json(tmp_path, script):
    spec = res(tmp_path, script, {"nnodes": "2"})
    data = spec.to_json()
    assert data["node_rank_auto"] is True
    assert JobSpec.from_json(data) == spec
    data.pop("node_rank_auto")  # a spec written before the field existed
    assert JobSpec.from_json(data).node_rank_auto is False

"""The contract between launcher, agent and rank: the rank's environment as one frozen
``RankEnv``, and the store's key names, in one module without torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from ftrun.common import contract
from ftrun.common.contract import IDENTITY_VARS, RankEnv

FULL = RankEnv(rank=5, local_rank=1, incarnation=2, generation=3, world_size=8, local_world_size=4, node=1, nnodes=2,
               master_addr="10.0.0.1", master_port=29501, attempt=1, max_restarts=4, run_id="ftrun-1-2",
               store_port=29500, control_addr="tcp://10.0.0.1:5555", heartbeat_interval=0.5, pg_timeout=60.0,
               cluster_time_out=120.0, arf=True, uce=False, ttp=True, recoverable_errors=("a.B", "C"),
               on_divergence="fail", checkpoint_dir="/ck", save_steps=10, resume_dir="/ck/step_9", resume_step=9,
               token="secret", fault="rank=1,step=3,kind=kill", check_trace="/tr", error_file="/e.json",
               hot_spare=False, spare_ready=None)


def test_it_goes_there_and_back() -> None:
    assert RankEnv.from_environ(FULL.to_environ()) == FULL
    assert RankEnv.from_environ(RankEnv().to_environ()) == RankEnv()


def test_the_names_ranks_have_always_had() -> None:
    env = FULL.to_environ()
    torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"}
    msrun = {"RANK_ID", "RANK_SIZE", "MS_WORKER_NUM", "MS_LOCAL_WORKER", "MS_NODE_RANK", "MS_ROLE", "MS_SCHED_HOST",
             "MS_SCHED_PORT", "DEVICE_ID"}
    ftrun = {"FTRUN_CONTROL_ADDR", "FTRUN_INCARNATION", "FTRUN_GENERATION", "FTRUN_ATTEMPT", "FTRUN_HEARTBEAT_INTERVAL",
             "FTRUN_PG_TIMEOUT", "FTRUN_CLUSTER_TIME_OUT", "FTRUN_ARF", "FTRUN_UCE", "FTRUN_TTP",
             "FTRUN_RECOVERABLE_ERRORS", "FTRUN_ON_DIVERGENCE", "FTRUN_CHECKPOINT_DIR", "FTRUN_SAVE_STEPS",
             "FTRUN_RESUME_DIR", "FTRUN_RESUME_STEP", "PYTHONUNBUFFERED"}
    assert torchrun | msrun | ftrun <= set(env)
    assert (env["RANK"], env["ROLE_RANK"], env["RANK_ID"], env["LOCAL_RANK"], env["DEVICE_ID"]) == ("5", "5", "5", "1", "1")
    assert (env["FTRUN_UCE"], env["FTRUN_RECOVERABLE_ERRORS"], env["TORCHELASTIC_RESTART_COUNT"]) == ("0", "a.B,C", "1")
    assert all(isinstance(v, str) for v in env.values())


def test_a_spare_has_no_identity() -> None:
    spare = FULL.without_identity()
    assert not spare.has_identity and FULL.has_identity
    env = spare.to_environ()
    assert not set(IDENTITY_VARS) & set(env)
    assert env["WORLD_SIZE"] == "8"  # the job's variables stay
    environ = FULL.to_environ()
    assert contract.strip_identity(environ) is environ and not set(IDENTITY_VARS) & set(environ)


def test_defaults_of_a_rank_outside_ftrun() -> None:
    env = RankEnv.from_environ({})
    assert (env.rank, env.world_size, env.attempt, env.control_addr) == (None, 1, 0, None)
    assert (env.pg_timeout, env.cluster_time_out, env.heartbeat_interval) == (300.0, 600.0, 1.0)
    assert (env.arf, env.uce, env.ttp, env.on_divergence) == (True, True, True, "warn")
    assert RankEnv.from_environ({"TORCHELASTIC_RESTART_COUNT": "3"}).attempt == 3  # plain torchrun's name
    assert RankEnv.from_environ({"TORCHELASTIC_RESTART_COUNT": "3", "FTRUN_ATTEMPT": "4"}).attempt == 4


def test_it_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.rank = 1  # type: ignore[misc]


def test_store_keys() -> None:
    assert contract.generation_prefix(2, 7) == "ftrun/attempt2/gen7/"
    assert contract.JOINED_KEY.format(rank=3) == "joined/3"
    assert (contract.node_key(1), contract.claim_key(1, 2)) == ("ftrun/node/1", "ftrun/claim/1/2")


def test_the_contract_does_not_import_torch() -> None:
    code = "import sys, ftrun.common.contract; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux /proc")
def test_a_promoted_spare_shows_its_identity_in_its_initial_environment() -> None:
    """What ``ps e`` reads (/proc/<pid>/environ, the block the process started with) names the rank
    after :func:`ftrun.rank.promotion.show_identity`, in the room the spare's environment ended with."""
    env = {k: v for k, v in os.environ.items() if k not in IDENTITY_VARS}
    env[contract.IDENTITY_PAD] = "-" * contract.IDENTITY_PAD_BYTES
    code = ("import os, sys; from ftrun.rank.promotion import show_identity; os.environ.pop('FTRUN_IDENTITY_PAD'); "
            "print(show_identity({'RANK': '3', 'LOCAL_RANK': '1', 'FTRUN_INCARNATION': '2', 'WORLD_SIZE': '4'}), flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "True"
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            items = [i.decode() for i in fh.read().split(b"\0") if i]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert ["RANK=3", "LOCAL_RANK=1", "FTRUN_INCARNATION=2"] == [i for i in items if i.split("=")[0] in IDENTITY_VARS]
    assert not [i for i in items if i.startswith("WORLD_SIZE=4")]  # only identity variables are written there
    # a process started without the room is left alone
    out = subprocess.run([sys.executable, "-c", "from ftrun.rank.promotion import show_identity; print(show_identity({'RANK': '1'}))"],
                         env={k: v for k, v in env.items() if k != contract.IDENTITY_PAD}, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "False"

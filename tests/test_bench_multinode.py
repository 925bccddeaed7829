"""scripts/bench.py's multinode part, pure logic only (no process, no namespace): the launchers'
command lines, the labels, and the digest check of the report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = _bench()
CASE = bench.Case("digits", "-", 4, 200, 60, victim=3, ckpt_every=25, nodes=2)


class FakeHost(SimpleNamespace):
    def env(self, base):
        return {**base, "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}


HOSTS = [FakeHost(addr="10.213.7.1"), FakeHost(addr="10.213.7.2")]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_ftrun_command_one_launcher_per_node_no_ifname(tmp_path: Path) -> None:
    for node in (0, 1):
        argv, env, script = bench.multinode_command("ftrun", CASE, node, HOSTS, tmp_path, "s" * 32)
        assert script == "train_digits.py"
        assert (_flag(argv, "--worker_num"), _flag(argv, "--local_worker_num")) == ("4", "2")
        assert _flag(argv, "--node_rank") == str(node)
        assert _flag(argv, "--master_addr") == "10.213.7.1"
        assert _flag(argv, "--tail_worker_log") == ("0" if node == 0 else "")
        assert env["FTRUN_TOKEN"] == "s" * 32
        assert "GLOO_SOCKET_IFNAME" not in env  # ftrun picks the interface itself


def test_torchrun_command_has_what_its_restart_needs(tmp_path: Path) -> None:
    for node in (0, 1):
        argv, env, script = bench.multinode_command("torchrun", CASE, node, HOSTS, tmp_path, "s" * 32)
        assert script == "train_digits_torchrun.py"
        assert (_flag(argv, "--nnodes"), _flag(argv, "--nproc-per-node")) == ("2", "2")
        assert _flag(argv, "--rdzv-backend") == "c10d"
        assert _flag(argv, "--rdzv-endpoint") == "10.213.7.1:29400"
        assert _flag(argv, "--rdzv-conf") == f"is_host={1 - node}"
        assert _flag(argv, "--local-addr") == HOSTS[node].addr
        assert _flag(argv, "--max-restarts") == "1"
        assert _flag(argv, "--ckpt_every") == "25"
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert "FTRUN_TOKEN" not in env


def test_labels() -> None:
    assert CASE.label() == "digits 2x2"
    assert bench.Case("digits", "-", 4, 120, 60).label() == "digits x4"
    assert bench.Case("charlm", "tiny", 8, 30, 15).label() == "charlm-tiny x8"


def test_groups_read_old_json_without_nodes() -> None:
    old = {"launcher": "ftrun", "repeat": 0, "case": {"workload": "digits", "size": "-", "ranks": 4}}
    assert list(bench._groups([old])) == [("digits", "-", 4, 1, False, None, False)]
    assert bench.Case("digits", "-", 4, 120, 60, hot=True).label() == "digits x4 hot"
    assert bench.Case("digits", "-", 4, 800, 170, hot=True, early=True).label() == "digits x4 hot early"
    assert bench.Case("digits", "-", 4, 1200, 300, nodes=2, hot=True, lost_node=0).label() == "digits 2x2 hot host0"


def _run(launcher: str, repeat: int, recover: float, digest: str) -> dict:
    final = f"final step=200 loss=0.1 test_accuracy=0.97 params_sha256={digest * 64}"
    return {"launcher": launcher, "repeat": repeat, "recover_s": recover, "final": final, "victim_node": 1,
            "case": {"workload": "digits", "size": "-", "ranks": 4, "nodes": 2}}


def test_notes_pairwise_ratios_and_digest_check() -> None:
    runs = [_run("ftrun", 0, 2.0, "a"), _run("torchrun", 0, 10.0, "b"),
            _run("ftrun", 1, 4.0, "a"), _run("torchrun", 1, 6.0, "c")]
    refs = [_run("ftrun", 0, 0.0, "a"), _run("torchrun", 0, 0.0, "b")]
    notes = bench.multinode_notes(runs, refs)
    assert notes[0] == "digits 2x2: torchrun/ftrun per pair: 5.00x, 1.50x"
    assert "ftrun: victim on node(s) [1]; params_sha256 equal to the fault-free ftrun run's: 2/2" in notes[1]
    assert "torchrun: victim on node(s) [1]; params_sha256 equal to the fault-free torchrun run's: 1/2" in notes[2]
    assert "no reference run" in bench.multinode_notes(runs, [])[1]


def test_elastic_part_plan_and_breakdown(tmp_path: Path) -> None:
    """The elastic part: one 3x2 case as an elastic job; ftrun's time split from node 0's events
    into detection, the --replace_timeout wait, the recovery and the retried step."""
    args = SimpleNamespace(parts=["elastic"], quick=True, worlds="2,4")
    (case,) = bench.plan(args)["elastic"]
    assert (case.ranks, case.nodes, case.elastic, case.victim) == (6, 3, True, 5) and case.label() == "digits 3x2 elastic"
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(json.dumps(e) for e in (
        {"time": 99.0, "kind": "node_lost", "detail": {}},  # an older loss: before the kill
        {"time": 100.5, "kind": "node_lost", "detail": {}},
        {"time": 103.6, "kind": "job_shrunk", "detail": {}},
        {"time": 106.0, "kind": "recovery_finished", "detail": {}})) + "\n")
    parts = bench.elastic_breakdown(events, kill_time=100.0, passed=106.4)
    assert parts == {"detection": 0.5, "wait": 3.1, "recovery": 2.4, "retried": 0.4}
    table = bench.elastic_table([{"launcher": "ftrun", "case": {"workload": "digits", "size": "-", "ranks": 6, "nodes": 3},
                                  "recover_s": 6.4, "breakdown": parts}])
    assert table[1].startswith("digits 3x2 elastic") and "3.100" in table[1]

"""Exactly-once checks without processes: fingerprints, the rank-state records a
respawned rank reads, the coordinator's answer to a ``divergence``, the ``--on_divergence`` option,
and ``ftrun check``'s verdict logic. The runs with real ranks are in tests/test_word_lm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ftrun.config import ConfigError
from ftrun.rank.digest import first_difference, fingerprint
from ftrun.common.protocol import MsgType
from ftrun.rank.rankstate import RankStateStore

from config_fixtures import res
from coordinator_fixtures import close_coordinators, events, hello_all, make, send  # noqa: F401


def test_fingerprint_sees_one_ulp_and_ignores_copies() -> None:
    a = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.arange(4, dtype=torch.int16)]
    b = [t.clone() for t in a]
    assert fingerprint(a) == fingerprint(b)
    b[1][2] = torch.nextafter(b[1][2], torch.tensor(9.0, dtype=torch.float64))
    assert fingerprint(a) != fingerprint(b)
    assert first_difference(["w", "v", "i"], a, b) == "v"
    assert first_difference(["w", "v", "i"], a, [t.clone() for t in a]) is None
    # Same values, another shape, or a missing gradient: another fingerprint.
    assert fingerprint([a[0]]) != fingerprint([a[0].reshape(4, 3)])
    assert fingerprint([a[0], None]) != fingerprint([a[0]])


def test_rank_records_say_where_they_were_taken_and_keep_the_gradient_fingerprint() -> None:
    records = RankStateStore(dist.HashStore(), attempt=0, rank=1)
    state = {"hidden": {"h": torch.ones(2)}}
    records.put(7, state, provisional=True)  # at step 7's all-reduce
    got = records.get(7)
    assert got is not None and got.provisional and got.label == 7 and torch.equal(got.state["hidden"]["h"], torch.ones(2))
    records.put(7, {"hidden": {"h": torch.zeros(2)}})  # at step 8's start: replaces it
    got = records.get(7)
    assert got is not None and not got.provisional and torch.equal(got.state["hidden"]["h"], torch.zeros(2))
    assert records.get(6) is None and records.get(9) is None  # another label in the slot, or none
    records.put_gradient_digest(8, "abc")
    assert records.get_gradient_digest(8) == "abc"
    assert records.get_gradient_digest(10) is None  # same slot, other step: never a stale match
    assert records.get_gradient_digest(9) is None


def counted_records() -> tuple[RankStateStore, list[str]]:
    """A rank's records on an in-memory store, and the keys of its writes, in order."""
    store = dist.HashStore()
    records = RankStateStore(store, attempt=0, rank=1)
    writes: list[str] = []
    real_set = store.set
    records._set = lambda key, value: writes.append(key) or real_set(key, value)  # type: ignore[method-assign]
    return records, writes


def test_the_provisional_record_carries_the_gradient_fingerprint_in_the_same_write() -> None:
    """One write to the job's store a step. The fingerprint of the local gradient rides
    on the provisional record, and on any later record of the same label; alone only when no
    record of the rank's state is kept."""
    records, writes = counted_records()
    state = {"data": {"position": torch.tensor(3)}}
    records.put(7, state, provisional=True, gradient="d7")
    assert writes == [f"{records.prefix}/1"] and records.get_gradient_digest(7) == "d7"
    records.put(7, {"data": {"position": torch.tensor(3)}}, mid_pass=True, gradient="d7")  # equal: not written
    records.put(7, {"data": {"position": torch.tensor(4)}}, mid_pass=True, gradient="d7")  # moved after the update
    assert len(writes) == 2 and records.get_gradient_digest(7) == "d7" and not records.get(7).provisional
    records.put(8, state, provisional=True)  # no fingerprint (checks off): none is made up
    assert records.get_gradient_digest(8) is None and records.get_gradient_digest(6) is None
    records.put_gradient_digest(8, "d8")  # kept alone
    assert records.get_gradient_digest(8) == "d8"


_KILLED_WRITER = """
import os, signal, sys
from datetime import timedelta
import torch.distributed as dist
from ftrun.rank.rankstate import RankStateStore
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
records = RankStateStore(store, attempt=0, rank=1)
records.put(7, {"hidden": {"h": bytes(range(256)) * 32}}, provisional=True)
os.kill(os.getpid(), signal.SIGKILL)  # right after the send, as a rank killed before its first bucket leaves
"""


def test_a_record_sent_right_before_a_sigkill_reaches_the_store() -> None:
    """Records are written on the training thread by ``TCPStore.set``, one request with no reply:
    what :mod:`ftrun.rank.rankstate` rests on is that a record whose ``put`` has returned is in the
    store even if the rank is SIGKILLed the next instant."""
    import subprocess
    import sys
    from datetime import timedelta

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(server.port)], timeout=60)
        assert proc.returncode == -9
        got = RankStateStore(server, attempt=0, rank=1).get(7)
        assert got is not None and got.provisional and got.state["hidden"]["h"] == bytes(range(256)) * 32
        server.delete_key(f"{RankStateStore(server, 0, 1).prefix}/1")


def test_a_failed_record_write_is_reported_once_and_does_not_stop_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    class Gone:
        def set(self, key: str, value: bytes) -> None:
            raise dist.DistNetworkError("Broken pipe")

    records = RankStateStore(Gone(), attempt=0, rank=1)
    records.put(7, {"hidden": {"h": torch.ones(2)}}, provisional=True)
    records.put(8, {"hidden": {"h": torch.ones(2)}}, provisional=True)
    records.put_gradient_digest(8, "abc")
    assert capsys.readouterr().err.count("could not write this rank's records") == 1


def test_a_step_start_record_equal_to_the_provisional_one_is_not_written_again() -> None:
    """Most steps change none of the rank's own state after their all-reduce, so the
    next step start would write the same bytes again. Inside a pass it is left out; at a pass's
    first step (where a successor reads the flag), after a change, or after another write it is not."""
    records, writes = counted_records()
    state = {"data": {"position": torch.tensor(3)}}
    records.put(7, state, provisional=True)
    records.put(7, {"data": {"position": torch.tensor(3)}}, mid_pass=True)
    assert len(writes) == 1
    assert records.get(7).provisional  # what the store holds: the same state
    records.put(8, state, provisional=True)
    records.put(8, {"data": {"position": torch.tensor(4)}}, mid_pass=True)  # the step's end moved it
    assert len(writes) == 3 and not records.get(8).provisional
    records.put(9, state, provisional=True)
    records.put(9, state)  # a pass's first step: the flag matters
    assert len(writes) == 5 and not records.get(9).provisional
    records.put(9, state, mid_pass=True)  # the last write was not provisional
    assert len(writes) == 6


def test_a_divergence_is_an_event_and_with_fail_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "warn").mkdir()
    (tmp_path / "fail").mkdir()
    coord, _, _ = make(tmp_path / "warn", world=2)
    hello_all(coord)
    send(coord, 1, MsgType.DIVERGENCE, step=12, check="gradient", reason="step 12 computed again differs")
    found = events(tmp_path / "warn", "divergence")
    assert [(e["rank"], e["detail"]["step"], e["detail"]["check"]) for e in found] == [(1, 12, "gradient")]
    assert coord.exit_code is None  # warn (the default): training goes on

    coord, _, _ = make(tmp_path / "fail", world=2, on_divergence="fail")
    hello_all(coord)
    stops: list[tuple[int, str]] = []
    monkeypatch.setattr(coord, "stop", lambda code, reason: stops.append((code, reason)) or code)
    send(coord, 0, MsgType.DIVERGENCE, step=5, check="replica_parameters", reason="parameters differ")
    assert coord.exit_code == 3
    assert len(stops) == 1 and "rank 0 diverged at step 5" in stops[0][1]
    assert "stopping" in events(tmp_path / "fail", "divergence")[0]["message"]


def test_on_divergence_option(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert res(tmp_path, str(script)).on_divergence == "warn"
    assert res(tmp_path, str(script), cli_values={"on_divergence": "FAIL"}).on_divergence == "fail"
    assert res(tmp_path, str(script), environ={"FTRUN_ON_DIVERGENCE": "fail"}).on_divergence == "fail"
    with pytest.raises(ConfigError, match="must be 'warn' or 'fail'"):
        res(tmp_path, str(script), cli_values={"on_divergence": "ignore"})
    assert json.loads(json.dumps(res(tmp_path, str(script)).to_json()))["on_divergence"] == "warn"


def _trace(steps: dict[int, list[str]], epochs: list[tuple[int, int]] = (), sections: list[tuple[str, int]] = (),
           divergences: list[dict] = (), rank: int = 0, incarnation: int = 0) -> dict:
    return {"rank": rank, "incarnation": incarnation, "names": ["model.a", "model.b"],
            "steps": {str(k): v for k, v in steps.items()},
            "epochs": [{"epoch": e, "first_step": s} for e, s in epochs],
            "sections": [{"name": n, "committed": c} for n, c in sections], "divergences": list(divergences)}


def test_check_picks_the_steps_where_scripts_go_wrong() -> None:
    from ftrun.tools.check import Trace, choose_scenarios

    reference = Trace({0: _trace({s: ["x", "y"] for s in range(40)}, epochs=[(1, 0), (2, 10), (3, 20), (4, 30)],
                                 sections=[("eval", 9), ("eval", 19), ("eval", 29), ("eval", 39)])})
    faults = [s.fault for s in choose_scenarios(reference, world=2)]
    assert faults == [
        "rank=1,step=4,point=allreduce,kind=kill",        # mid first epoch: survivors compute it again
        "rank=1,step=29,point=between_steps,kind=kill",   # the last step of the second-to-last epoch
        "rank=1,step=30,point=before_forward,kind=kill",  # the last epoch's first step
        "rank=1,step=19,point=section,kind=kill",         # inside an evaluation
    ]
    plain = Trace({0: _trace({s: ["x"] for s in range(30)})})  # ft.steps(): no epochs, no sections
    assert [s.step for s in choose_scenarios(plain, world=4)] == [9, 14, 19]
    assert [s.kind for s in choose_scenarios(reference, world=2)] == ["allreduce", "epoch_end", "epoch_start", "section"]
    assert [s.kind for s in choose_scenarios(plain, world=4)] == ["allreduce", "epoch_end", "epoch_start"]


def test_check_scenarios_option_names_a_subset() -> None:
    from ftrun.tools.check import parse_scenarios

    assert parse_scenarios(None) is None and parse_scenarios("") is None
    assert parse_scenarios("allreduce, section") == {"allreduce", "section"}
    with pytest.raises(ValueError, match="unknown scenario midway; choose from allreduce, epoch_end"):
        parse_scenarios("allreduce,midway")


def test_check_names_the_first_step_and_tensor_and_the_likely_cause() -> None:
    from ftrun.tools.check import Scenario, Trace, explain, first_difference

    good = {s: ["a%d" % s, "b%d" % s] for s in range(12)}
    reference = Trace({0: _trace(good, epochs=[(1, 0), (2, 6)]), 1: _trace(good, rank=1, epochs=[(1, 0), (2, 6)])})
    same = Trace({0: _trace(good), 1: _trace({s: good[s] for s in range(4, 12)}, rank=1, incarnation=1)})
    assert first_difference(reference, same) is None
    bad = dict(good)
    bad.update({s: [good[s][0], "other"] for s in range(7, 12)})
    run = Trace({0: _trace(bad), 1: _trace({s: bad[s] for s in range(5, 12)}, rank=1, incarnation=1)})
    diff = first_difference(reference, run)
    assert diff is not None and (diff.step, diff.tensor) == (7, "model.b")
    scenario = Scenario("after the epoch's last step", "rank=1,step=5,point=between_steps,kind=kill", 5)
    # The same gradients, other updates, after an epoch boundary: state outside the registered one.
    why = explain(diff, [], scenario, reference)
    assert "module-level variable" in why and "epoch boundary at step 6" in why
    # A recomputed step with another gradient: carried state in the forward pass.
    why = explain(diff, [{"rank": 0, "step": 5, "check": "gradient", "reason": "..."}], scenario, reference)
    assert "rank 0 computed step 5 again" in why and "hidden state" in why


class _Position:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "seen": torch.tensor([self.position])}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def test_the_step_start_copy_of_rank_state_is_its_record_and_rolls_back() -> None:
    """At a step start one walk gives both the copy a retried step rolls back to and the
    rank's record (the same bytes as encoding the state alone); replica objects keep a deep copy."""
    import random

    import numpy as np

    from ftrun.common import codec
    from ftrun.rank.registry import StateRegistry
    from ftrun.rank.transfer import RNGState

    registry = StateRegistry()
    registry.register("rng", RNGState(), kind="rank")
    registry.register("data", _Position(), kind="rank")
    registry.register("epochs", _Position())  # replica
    np.random.seed(1)
    np.random.standard_normal()  # a cached gaussian in the state
    registry["data"].position = registry["epochs"].position = 3
    blob = registry.snapshot_step_start(5, encode_rank=True)
    assert blob == codec.to_record(registry.record_state()) and blob[0] == 0x92  # the fast record format
    draws = (torch.rand(2), np.random.standard_normal(2), random.random())
    registry["data"].position = registry["epochs"].position = 4
    assert not registry.roll_back(4, ("rank", "replica"))  # another step's copy
    assert registry.roll_back(5, ("rank",))
    assert (registry["data"].position, registry["epochs"].position) == (3, 4)
    assert torch.equal(torch.rand(2), draws[0]) and np.array_equal(np.random.standard_normal(2), draws[1]) and random.random() == draws[2]
    assert registry.roll_back(5, ("rank", "replica"))  # again: decoded afresh
    assert (registry["data"].position, registry["epochs"].position) == (3, 3)
    assert torch.equal(torch.rand(2), draws[0])
    assert registry.snapshot_step_start(6) is None  # no record kept: every kind deep-copied
    registry["data"].position = 9
    assert registry.roll_back(6, ("rank",)) and registry["data"].position == 3


def test_the_gradient_record_has_the_codecs_bytes() -> None:
    from ftrun.common import codec

    store = dist.HashStore()
    records = RankStateStore(store, attempt=0, rank=1)
    records.put_gradient_digest(8, "ab" * 16)
    assert bytes(store.get(f"{records.prefix}/grad/0")) == codec.to_bytes({"step": 8, "digest": "ab" * 16})


def test_the_unwrapped_models_all_reduce_writes_the_provisional_record_before_anything_leaves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model averaged by the optimizer wrapper (no ``wrap_model``) writes its provisional record
    too, before its gradients leave: without it, a rank that died after its peers committed the
    step left its successor no record of its own state at that step."""
    from types import SimpleNamespace

    from ftrun.rank import gradsync

    order: list[str] = []
    monkeypatch.setattr(gradsync, "all_reduce_in_buckets", lambda grads, world, cap: order.append("all-reduce"))
    sync = SimpleNamespace(
        world_size=2, state=SimpleNamespace(error=None), in_collective=False,
        checks=SimpleNamespace(record_provisional=lambda: order.append("provisional")),
        control=SimpleNamespace(board=SimpleNamespace(collective=lambda: order.append("board"))),
        release_if_aborted=lambda: None, progress=SimpleNamespace(current_step=5),
        faults=SimpleNamespace(point=lambda where, step: order.append(where)),
        transaction=SimpleNamespace(backward_pass=lambda: order.append("pass")))
    sync._at_pass_start = lambda: gradsync.GradientSync._at_pass_start(sync)  # type: ignore[arg-type]
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    assert gradsync.GradientSync.all_reduce(sync, [param])  # type: ignore[arg-type]
    assert order == ["pass", "provisional", "board", "allreduce", "all-reduce"]


def test_a_steps_record_is_written_when_its_backward_starts_and_its_fingerprint_after_its_last_bucket() -> None:
    """Made right before the step's last bucket, the provisional record was what every
    rank waited for at the step's most expensive moment (4 to 7% of a small step). It is written
    when the synced backward starts (the rank state is final then; nothing has left), the local
    gradient's fingerprint in a write of its own once the last bucket has left, and the next step
    start, with an equal state, writes nothing: two writes a step, neither between the last
    gradient and the all-reduce."""
    from types import SimpleNamespace

    from ftrun.rank.exactlyonce import ExactlyOnceChecks
    from ftrun.rank.recovery import RankProgress
    from ftrun.rank.registry import StateRegistry
    from ftrun.rank.workerstate import WorkerState

    store = dist.HashStore()
    writes: list[str] = []
    real_set = store.set
    position = {"at": 0}

    class Cursor:
        def state_dict(self) -> dict:
            return {"position": position["at"]}

        def load_state_dict(self, state: dict) -> None:
            position["at"] = state["position"]

    registry = StateRegistry()
    registry.register("data", Cursor(), kind="rank")
    progress = RankProgress()
    progress.committed = 4
    checks = ExactlyOnceChecks(progress, registry, SimpleNamespace(predecessor_gradient=None),
                               SimpleNamespace(store=lambda: store, store_moves=0, cluster_timeout=60.0,
                                               conns=SimpleNamespace(keep_ports=set())), WorkerState(managed=True),
                               send=lambda *a, **k: None, poll_abort=lambda timeout: False, world_size=2, seed=None,
                               on_divergence="warn")
    checks.bind(1, 0, torch.device("cpu"), [1])
    checks.keeps_rank_records()
    checks.rank_states._set = lambda key, value: writes.append(key) or real_set(key, value)  # type: ignore[method-assign]
    prefix = checks.rank_states.prefix
    for step in (5, 6):
        progress.current_step = step
        checks.snapshot_step_start(mid_pass=True)  # equal to the last provisional record: not written
        position["at"] += 1  # the batch
        checks.record_provisional()  # the backward's first gradient
        assert checks.check_local_gradient(f"d{step}")  # before the last bucket leaves
        checks.record_gradient()  # after it left
        progress.committed = step
    # The first step start has no provisional record to equal (label 4); the second equals step 5's.
    assert writes == [f"{prefix}/0", f"{prefix}/1", f"{prefix}/grad/1", f"{prefix}/0", f"{prefix}/grad/0"]
    assert checks.rank_states.get_gradient_digest(6) == "d6" and checks.rank_states.get_gradient_digest(5) == "d5"
    record = checks.rank_states.get(6)
    assert record is not None and record.provisional and record.state == {"data": {"position": 2}}

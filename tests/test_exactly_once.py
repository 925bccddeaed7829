"""Exactly-once checks without processes (issue 20): fingerprints, the rank-state records a
respawned rank reads, the coordinator's answer to a ``divergence``, the ``--on_divergence`` option,
and ``ftrun check``'s verdict logic. The runs with real ranks are in tests/test_word_lm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ftrun.config import ConfigError
from ftrun.digest import first_difference, fingerprint
from ftrun.protocol import MsgType
from ftrun.rankstate import RankStateStore

from test_config import res
from test_coordinator import events, hello_all, make, send


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


def test_a_divergence_is_an_event_and_with_fail_stops_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "warn").mkdir()
    (tmp_path / "fail").mkdir()
    coord, _, _ = make(tmp_path / "warn", world=2)
    hello_all(coord)
    send(coord, 1, MsgType.DIVERGENCE, step=12, check="gradient", reason="step 12 computed again differs")
    found = events(tmp_path / "warn", "divergence")
    assert [(e["rank"], e["detail"]["step"], e["detail"]["check"]) for e in found] == [(1, 12, "gradient")]
    assert coord._pending_exit is None  # warn (the default): training goes on

    coord, _, _ = make(tmp_path / "fail", world=2, on_divergence="fail")
    hello_all(coord)
    stops: list[tuple[int, str]] = []
    monkeypatch.setattr(coord, "stop", lambda code, reason: stops.append((code, reason)) or code)
    send(coord, 0, MsgType.DIVERGENCE, step=5, check="replica_parameters", reason="parameters differ")
    assert coord._pending_exit == 3
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

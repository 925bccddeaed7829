"""The CUDA path's logic, tested without a GPU and without processes (ftrun.rank.cuda): the NCCL settings of
a rank's environment, the choice of a rank's and a spare's device, the release of a blocked group (NCCL
abort or gloo cut), the wait for a GPU's memory with a fake clock and a fake probe, and a state
transfer's placement of tensors by their recorded device. What needs a GPU is in tests/test_gpu.py."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed as dist

from ftrun.common import contract
from ftrun.rank import cuda
from ftrun.rank.cuda import DeviceMemory, Release


# ----------------------------------------------------------------------------- NCCL settings
def test_a_managed_rank_gets_the_nccl_settings_and_the_users_own_win() -> None:
    assert contract.nccl_environment({}, managed=True) == contract.NCCL_SETTINGS
    assert contract.NCCL_SETTINGS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # clean up only: the process lives
    assert contract.NCCL_SETTINGS["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    mine = contract.nccl_environment({"TORCH_NCCL_BLOCKING_WAIT": "0"}, managed=True)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in mine and len(mine) == len(contract.NCCL_SETTINGS) - 1
    assert contract.nccl_environment({}, managed=False) == {}  # a whole-job restart keeps torch's defaults


def test_the_agent_puts_them_in_a_recovered_ranks_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrun.node.spawner import RankProcesses

    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the user's choice
    procs = RankProcesses(["python"], ["x.py"], False, tmp_path, 1, "127.0.0.1", False, "secret")
    env = procs.environment({"FTRUN_ARF": "1", "RANK": "0"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    plain = procs.environment({"FTRUN_ARF": "0", "RANK": "0"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in plain


def test_the_agent_names_a_respawned_ranks_predecessor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ftrun.common import procs as procs_mod
    from ftrun.node.spawner import RankProcesses

    started = []

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    def spawn(argv, env, **_kw):  # type: ignore[no-untyped-def]
        started.append(env)
        return Proc(1000 + len(started))

    monkeypatch.setattr(procs_mod, "spawn", spawn)
    rp = RankProcesses([sys.executable], ["x.py"], False, tmp_path, 1, "127.0.0.1", False, "secret")
    rp.spawn(0, 0, {"FTRUN_ARF": "1"}, "start\n", use_spare=False)
    rp.spawn(0, 1, {"FTRUN_ARF": "1"}, "respawn\n", use_spare=False)
    assert cuda.PREVIOUS_PID not in started[0] and started[1][cuda.PREVIOUS_PID] == "1001"


# ----------------------------------------------------------------------------- devices
@pytest.mark.parametrize("backend, requested, local_rank, count, expected", [
    ("gloo", None, 3, 0, "cpu"),
    ("gloo", "cpu", 3, 1, "cpu"),
    ("gloo", "cuda", 3, 1, "cuda:0"),  # 4 ranks on one GPU
    ("gloo", "cuda", 3, 2, "cuda:1"),
    ("nccl", None, 1, 2, "cuda:1"),
    ("nccl", "cuda", 0, 1, "cuda:0"),
    ("gloo", "cuda:1", 0, 2, "cuda:1"),
])
def test_a_ranks_device(backend: str, requested: str | None, local_rank: int, count: int, expected: str) -> None:
    assert cuda.choose_device(backend, requested, local_rank, count) == expected


@pytest.mark.parametrize("backend, requested, local_rank, count, says", [
    ("nccl", "cpu", 0, 1, "NCCL carries CUDA tensors only"),
    ("gloo", "cuda", 0, 0, "sees no GPU"),
    ("nccl", None, 1, 1, "NCCL needs a GPU per rank"),  # two NCCL ranks on one GPU: refused by NCCL
    ("gloo", "cuda:2", 0, 2, "sees 2 GPU"),
    ("gloo", "tpu", 0, 0, "neither"),
])
def test_a_device_that_cannot_be_is_one_line(backend: str, requested: str | None, local_rank: int, count: int,
                                             says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        cuda.choose_device(backend, requested, local_rank, count)
    assert "\n" not in str(err.value)


def test_bind_device_on_a_machine_without_a_gpu() -> None:
    device, waited = cuda.bind_device("gloo", None, 2, 2, respawned=True)
    assert device == torch.device("cpu") and waited is None  # no GPU: nothing to wait for
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            cuda.bind_device("gloo", "cuda", 0, 0, respawned=False)


@pytest.mark.parametrize("backend, requested, count, expected", [
    ("gloo", None, 1, "cpu"),
    ("gloo", "cuda", 1, "cuda:0"),  # every rank of the node shares the one GPU: known before promotion
    ("gloo", "cuda", 2, None),  # its GPU comes with its rank
    ("nccl", None, 1, None),  # NCCL: one GPU per rank, never known before
    ("nccl", "cuda:0", 1, "cuda:0"),
])
def test_a_spares_device_before_its_promotion(backend: str, requested: str | None, count: int,
                                              expected: str | None) -> None:
    assert cuda.spare_device(backend, requested, count) == expected


# ----------------------------------------------------------------------------- releasing a blocked group
def test_nccl_is_aborted_and_gloo_is_cut() -> None:
    assert cuda.release_for("nccl") is Release.ABORT_COMMUNICATORS
    assert cuda.release_for("gloo") is Release.CUT_CONNECTIONS


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_group_releases_by_its_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrun.rank import group as group_mod

    calls: list[str] = []
    monkeypatch.setattr(group_mod, "abort_group", lambda g: calls.append("abort") or True)  # given dist.group.WORLD
    g = group_mod.TrainingGroup(backend, 2, 30.0, 30.0)
    monkeypatch.setattr(g.conns, "cut", lambda: calls.append("cut"))
    monkeypatch.setattr(g, "live", lambda: True)
    g.cut()
    assert calls == (["abort"] if backend == "nccl" else ["cut"])
    monkeypatch.setattr(g, "live", lambda: False)  # no group (between generations): nothing to abort
    calls.clear()
    g.cut()
    assert calls == ([] if backend == "nccl" else ["cut"])


def test_a_failing_abort_is_logged_not_raised(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from ftrun.rank import group as group_mod

    def abort(_g):  # type: ignore[no-untyped-def]
        raise RuntimeError("already destroyed")

    monkeypatch.setattr(group_mod, "abort_group", abort)
    g = group_mod.TrainingGroup("nccl", 2, 30.0, 30.0)
    monkeypatch.setattr(g, "live", lambda: True)
    g.cut()  # the I/O thread must go on
    assert "aborting the NCCL group failed" in capsys.readouterr().err


def test_the_io_threads_nccl_abort_runs_on_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cut(wait=False)`` returns while ``abort()`` is held (on a GPU it waits for the work queued
    ahead); the teardown's ``cut()`` joins that abort rather than making a second; a new generation's
    group is aborted afresh."""
    import threading

    from ftrun.rank import group as group_mod

    entered, let_go, calls = threading.Event(), threading.Event(), []

    def abort(_g):  # type: ignore[no-untyped-def]
        calls.append(threading.current_thread().name)
        entered.set()
        assert let_go.wait(10)
        return True

    monkeypatch.setattr(group_mod, "abort_group", abort)
    g = group_mod.TrainingGroup("nccl", 2, 30.0, 30.0)
    monkeypatch.setattr(g, "live", lambda: True)
    g.cut(wait=False)
    assert entered.wait(10) and calls == ["ftrun-nccl-abort"]
    g.cut(wait=False)  # another abort while the first is held: nothing more
    joined = threading.Thread(target=g.cut)
    joined.start()
    joined.join(0.2)
    assert joined.is_alive(), "the waiting cut did not wait for the abort in flight"
    let_go.set()
    joined.join(10)
    assert not joined.is_alive() and calls == ["ftrun-nccl-abort"]
    g._aborting = None  # as build() does for a new generation's group
    g.cut()
    assert calls == ["ftrun-nccl-abort", threading.current_thread().name]


def test_abort_group_calls_torchs_abort() -> None:
    aborted = []

    class Group:
        def abort(self) -> None:
            aborted.append(True)

    assert cuda.abort_group(Group()) and aborted == [True]
    assert not cuda.abort_group(None) and not cuda.abort_group(object())


# ----------------------------------------------------------------------------- a GPU's memory
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


GIB = 1 << 30


def test_the_wait_ends_when_the_predecessor_holds_nothing() -> None:
    clock = FakeClock()

    def probe() -> DeviceMemory:  # the driver frees the killed process's 30 GiB at t+3 s
        held = 30 * GIB if clock.now < 103.0 else 0
        return DeviceMemory(free=100 * GIB - held, total=140 * GIB, predecessor=held)

    waited = cuda.wait_for_memory(probe, timeout_s=60, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert waited.ready and waited.how == "predecessor" and waited.waited_s == pytest.approx(3.0)
    assert "memory ready (waited 3.00 s, predecessor; free 100.0 of 140.0 GiB)" in waited.line(2, "cuda:0")


def test_without_nvml_the_wait_ends_when_free_memory_settles() -> None:
    clock = FakeClock()

    def probe() -> DeviceMemory:  # free memory grows until t+2 s, then stays
        return DeviceMemory(free=int(min(clock.now - 100.0, 2.0) * 10 * GIB), total=140 * GIB, predecessor=None)

    waited = cuda.wait_for_memory(probe, timeout_s=60, settle_s=0.5, poll_s=0.1, clock=clock, sleep=clock.sleep)
    assert waited.ready and waited.how == "settled"
    assert 2.5 <= waited.waited_s <= 2.7 and waited.last.free == 20 * GIB


def test_the_wait_is_bounded_and_says_so() -> None:
    clock = FakeClock()
    polls = []

    def probe() -> DeviceMemory:  # never freed
        polls.append(clock.now)
        return DeviceMemory(free=10 * GIB, total=140 * GIB, predecessor=20 * GIB)

    waited = cuda.wait_for_memory(probe, timeout_s=50, poll_s=1.0, clock=clock, sleep=clock.sleep)
    assert not waited.ready and waited.how == "timeout" and waited.waited_s == pytest.approx(50.0)
    assert len(polls) == 51 and "not freed after 50.0 s; going on" in waited.line(1, "cuda:0")


def test_a_fresh_gpu_is_ready_at_once() -> None:
    clock = FakeClock()
    waited = cuda.wait_for_memory(lambda: DeviceMemory(140 * GIB, 140 * GIB, 0), clock=clock, sleep=clock.sleep)
    assert waited.ready and waited.waited_s == 0.0


# ----------------------------------------------------------------------------- transfers
@pytest.mark.parametrize("ref, local, expected", [
    ("cpu", "cuda:0", "cpu"),
    ("cuda:3", "cuda:0", "cuda:0"),  # the donor's GPU index means nothing on the recipient
    ("cuda:0", None, "cpu"),  # a process without a GPU keeps it on the CPU
])
def test_a_received_tensor_goes_home(ref: str, local: str | None, expected: str) -> None:
    assert cuda.placement(ref, local) == expected


def test_wire_device_is_the_cpu_with_gloo() -> None:
    assert cuda.wire_device("gloo") == "cpu"


def test_a_transfer_keeps_each_tensors_device_and_places_it_by_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a fake wire (no processes): the skeleton sent records each tensor's device, and the
    recipient places every received tensor by that record (ftrun.rank.cuda.placement), bitwise."""
    from ftrun.rank import transfer

    state = {"model": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}, "rng": torch.randint(0, 255, (8,), dtype=torch.uint8)}
    wire: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: wire.append(t.clone()))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: t.copy_(wire.pop(0)))
    transfer.send_state(state, dst=1)
    skeleton = msgpack.unpackb(wire[1].numpy().tobytes(), raw=False, strict_map_key=False)
    from ftrun.common import codec

    assert {ref["path"]: ref["device"] for ref in codec.tensor_refs(skeleton)} == {
        "state['model']['w']": "cpu", "state['model']['b']": "cpu", "state['rng']": "cpu"}
    placed = []
    monkeypatch.setattr(transfer, "placement", lambda ref, local: placed.append((ref, local)) or "cpu")
    received, _ = transfer.recv_state(0, {"model": {"w": torch.zeros(3, 4)}})
    assert not wire and len(placed) == 3 and all(ref == "cpu" for ref, _ in placed)
    assert torch.equal(received["model"]["w"], state["model"]["w"]) and torch.equal(received["model"]["b"], state["model"]["b"])
    assert torch.equal(received["rng"], state["rng"])


def test_gpu_check_reads_the_memory_wait_line_ftrun_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu_check.py finds the respawned rank's wait in its log by the line ftrun.rank.cuda writes."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    look = DeviceMemory(100 * GIB, 140 * GIB, 0)
    for waited, expected in [(cuda.MemoryWait(0.42, True, look, "predecessor"), {"ready": True, "waited_s": 0.42, "how": "predecessor"}),
                             (cuda.MemoryWait(60.0, False, look, "timeout"), {"ready": False, "waited_s": 60.0, "how": "timeout"})]:
        (tmp_path / "worker_2.log").write_text(f"step 3\n{waited.line(2, 'cuda:0')}\nmore\n")
        assert gpu_check.memory_wait(tmp_path, 2) == expected
    assert gpu_check.memory_wait(tmp_path, 3) is None
    evs = [{"kind": "rank_started", "rank": r, "pid": 10 + r} for r in range(4)] + [{"kind": "rank_started", "rank": 2, "pid": 20}]
    assert gpu_check.survivors_kept(evs, {2}) and not gpu_check.survivors_kept(evs, set())

"""A rank's side of the control plane, without processes: the channel's I/O thread and how the
recovery loop uses the coordinator's messages."""

from __future__ import annotations

import pytest

from ftrun.common.protocol import CONTROL, MsgType, Receiver, Sender, decode, encode, pack, to_peer, unpack

TOKEN = "a" * 64


def test_channel_io_thread_survives_a_failing_handler(capfd):
    """An exception in the I/O thread's handler (the worker cuts connections there) must not end the
    thread: the message still reaches the training thread and heartbeats go on."""
    import time

    import zmq

    from ftrun.rank.channel import Channel

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(f"tcp://127.0.0.1:{port}", TOKEN, rank=0, incarnation=0, heartbeat_interval=0.05)
    try:
        def fail(_msg):
            raise RuntimeError("handler broke")

        channel.on_receive = fail
        assert router.poll(10_000), "no heartbeat from the channel"
        identity, frame = router.recv_multipart()
        assert decode(frame, Receiver(TOKEN, CONTROL)).type == MsgType.HEARTBEAT
        router.send_multipart([identity, encode(MsgType.ABORT, Sender(TOKEN), to_peer(identity), generation=3, reason="test")])
        msg = channel.receive(timeout=10.0)
        assert msg is not None and msg.type == MsgType.ABORT and msg["generation"] == 3
        deadline = time.monotonic() + 10.0
        beats_after = 0
        while beats_after < 2 and time.monotonic() < deadline:
            if router.poll(100):
                router.recv_multipart()
                beats_after += 1
        assert beats_after == 2, "the I/O thread stopped sending heartbeats"
        assert "handler broke" in capfd.readouterr().err
    finally:
        channel.close()
        router.close()


def test_recovery_uses_a_plan_taken_with_its_abort():
    """A plan that arrived right behind its abort (both taken by one poll, before the rank entered
    its recovery loop) is carried out, not dropped: dropping it left the rank waiting for a plan
    that had come, until the coordinator replaced it as hung."""
    from ftrun.rank.client import ControlClient
    from ftrun.common.faults import FaultInjector
    from ftrun.rank.recovery import RankProgress, Recovery
    from ftrun.rank.registry import StateRegistry

    sent = []

    class Quiet:
        calls = 0

        def receive(self, timeout=0.0):
            Quiet.calls += 1
            assert Quiet.calls < 3, "the rank waits for a plan it already has"
            return None

        def send(self, msg_type, **fields):
            sent.append((msg_type, fields))

    class Group:
        def drop(self, generation, broken=True):
            pass

    progress = RankProgress(committed=4, generation=1)
    control = ControlClient()
    control.channel = Quiet()
    built = []
    recovery = Recovery(progress, Group(), control, StateRegistry(),
                        build_group=lambda generation: built.append(generation) or True, safe_point=lambda: None, seed=None)
    recovery.bind(rank=1, attempt=0, faults=FaultInjector([], 1, 0, 0), fresh=False)
    control.abort_generation = 2
    control.plan = unpack(pack(MsgType.RECONFIGURE, generation=2, world_size=2, step=4, transfers=[]))
    assert recovery.recover(None, "comm") == 4
    assert built == [2] and control.abort_generation is None and progress.committed == 4
    assert [t for t, _ in sent] == [MsgType.RECOVERED]


def test_an_abandoned_all_reduce_failing_late_leaves_later_passes_alone(monkeypatch):
    """An all-reduce abandoned after an abort can fail long after its pass ended (its group was
    retired, not joined); that failure must not mark a later, healthy pass failed (nothing is
    attached to a work: a pass looks only at its own works, in :meth:`GradientReducer.wait`)."""
    import threading

    import torch

    from ftrun.rank import reducer as reducer_mod

    works = []

    class Work:
        def __init__(self):
            self.error = None
            works.append(self)

        def wait(self, timeout=None):
            if self.error is not None:
                raise self.error
            return True

        def is_completed(self):
            return True

    monkeypatch.setattr(reducer_mod.dist, "all_reduce", lambda flat, async_op: Work())
    param = torch.nn.Parameter(torch.ones(3))
    red = reducer_mod.GradientReducer([param], 2, before_first_bucket=lambda: None, is_failed=lambda: False,
                                      on_hook_error=lambda err: False, on_failure=lambda reason: None,
                                      waiting=threading.Event(), abandon=threading.Event())
    red._pending.append(([0], torch.ones(3), red.launch(torch.ones(3)), False))  # pass 1: abandoned, still in flight
    red._reset_pass()  # pass 2 begins
    red._pending.append(([0], torch.ones(3), red.launch(torch.ones(3)), False))
    works[0].error = RuntimeError("Connection reset by peer")  # pass 1's work fails now
    red.wait()
    assert red.error is None
    red._pending.append(([0], torch.ones(3), red.launch(torch.ones(3)), False))
    works[-1].error = RuntimeError("peer gone")  # a failure of this pass counts
    red.wait()
    assert red.error and "peer gone" in red.error


def test_a_gloo_group_is_unregistered_and_never_destructed():
    """Broken or ending cleanly, under ftrun or not, a gloo group is unregistered but never
    destructed: gloo's destructor joins threads that may still run a collective, or wait for the
    GIL the destructor holds to free their last work."""
    import torch.distributed as dist

    from ftrun.rank import group as group_mod

    for managed in (True, False):
        group = group_mod.TrainingGroup("gloo", world_size=1, pg_timeout=30, cluster_timeout=30)
        group.bind(rank=0, incarnation=0, attempt=0, managed=managed)
        for broken in (True, False):
            before = group_mod.retired_groups
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            group.drop(generation=0, broken=broken)
            assert not dist.is_initialized()
            assert group_mod.retired_groups - before == 1


def test_a_bucket_all_reduce_started_directly_is_dist_all_reduce():
    """The reducer starts a bucket's all-reduce on the default group without
    ``dist.all_reduce``'s wrapper; it must give the same result in place (a complex tensor takes
    ``dist.all_reduce`` itself), and fail like it between generations (the placeholder group)."""
    import torch
    import torch.distributed as dist

    from ftrun.rank.group import GroupDown, TrainingGroup
    from ftrun.rank.reducer import start_all_reduce

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = TrainingGroup("gloo", world_size=4, pg_timeout=30, cluster_timeout=30)
    group.bind(rank=1, incarnation=0, attempt=0, managed=True)
    try:
        for tensor in (torch.arange(5.0), torch.ones(3, dtype=torch.complex64), torch.arange(6).reshape(2, 3)[:, 1]):
            expected = tensor.clone()
            dist.all_reduce(expected)
            start_all_reduce(tensor).wait()
            assert torch.equal(tensor, expected)
        group.drop(generation=1, broken=True)  # the placeholder stands in
        with pytest.raises(GroupDown, match="process group is down"):
            start_all_reduce(torch.ones(2))
    finally:
        group.drop(generation=1, broken=False)
    assert not dist.is_initialized()


def test_between_generations_the_default_group_knows_its_rank_and_fails_collectives():
    """While a rank has no live group, a placeholder default group answers
    get_rank()/get_world_size() and fails every collective at once; a broken drop keeps it, a
    clean one (ft.finish()) leaves no group, and building the next generation replaces it."""
    import torch
    import torch.distributed as dist

    from ftrun.rank.group import GroupDown, TrainingGroup

    group = TrainingGroup("gloo", world_size=4, pg_timeout=30, cluster_timeout=30)
    group.bind(rank=2, incarnation=0, attempt=0, managed=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group.drop(generation=1, broken=True)  # a failed step: the real group goes, the placeholder stands
    try:
        assert dist.is_initialized() and not group.live()
        assert (dist.get_rank(), dist.get_world_size()) == (2, 4)
        for call in (lambda: dist.all_reduce(torch.ones(2)), lambda: dist.all_reduce(torch.ones(2), async_op=True),
                     lambda: dist.broadcast(torch.ones(2), src=0)):
            with pytest.raises(GroupDown, match="process group is down"):
                call()
        group.drop(generation=1, broken=True)  # already down: nothing changes
        assert dist.get_rank() == 2
    finally:
        group.drop(generation=1, broken=False)
    assert not dist.is_initialized()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _board():
    from ftrun.rank.client import StepBoard
    from ftrun.rank.recovery import RankProgress

    clock = _Clock()
    return StepBoard(RankProgress(), clock=clock), clock


def test_step_board_gives_phases_as_ages_and_each_step_time_once():
    """The heartbeat carries where the training thread is (no message a step): the
    phase and its age, the step and committed step, and the step times since the previous beat,
    each once."""
    board, clock = _board()
    assert board.fields()["phase"] == "setup" and "samples" not in board.fields()
    for step, took in enumerate((0.5, 0.2, 0.3, 0.1)):
        board.progress.current_step = step
        board.begin(step, 10)
        clock.now += 0.05
        board.collective()
        board.enter("update")
        board.progress.committed = step
        board.enter("compute")
        clock.now += took - 0.05
    clock.now += 0.25
    fields = board.fields()
    assert fields["step"] == 3 and fields["committed"] == 3 and fields["total"] == 10
    assert fields["phase"] == "compute" and fields["phase_age"] == pytest.approx(0.3)
    assert fields["compute"] == pytest.approx(0.05) and fields["last_step"] == pytest.approx(0.3)
    # three intervals between four begins: 0.5, 0.2, 0.3 (the last step has not ended)
    assert fields["samples"] == 3 and fields["step_times"] == pytest.approx([0.5, 0.2, 0.3]) and "step_max" not in fields
    assert "samples" not in board.fields(), "a sample told twice"
    board.progress.current_step = 4
    board.begin(4, 10)
    fields = board.fields()
    assert fields["samples"] == 4 and fields["step_times"] == pytest.approx([0.35])


def test_step_board_lists_the_newest_step_times_and_folds_the_older_ones():
    from ftrun.rank.client import SAMPLES_LISTED

    board, clock = _board()
    for step in range(SAMPLES_LISTED + 6):
        board.begin(step, None)
        clock.now += 2.0 if step == 1 else 0.01
    board.begin(SAMPLES_LISTED + 6, None)
    fields = board.fields()
    assert fields["samples"] == SAMPLES_LISTED + 6 and len(fields["step_times"]) == SAMPLES_LISTED
    assert (fields["step_max_from"], fields["step_max"]) == (1, pytest.approx(2.0))  # samples 1-6, the second 2 s


def test_step_board_takes_no_step_time_across_a_section_or_a_recovery():
    board, clock = _board()
    board.begin(0, None)
    clock.now += 1.0
    board.section_closed()  # an evaluation inside the step interval
    clock.now += 0.1
    board.begin(1, None)
    assert "samples" not in board.fields()
    clock.now += 0.1
    board.begin(2, None)
    assert board.fields()["step_times"] == pytest.approx([0.1])
    board.enter("recovering")
    clock.now += 5.0
    board.enter("compute")
    board.begin(3, None)  # the step after the recovery step: its interval spans the recovery
    assert "samples" not in board.fields()


def test_control_messages_move_the_board_before_they_leave():
    """A fault report, a recovery's end and the loop's end set the board's phase before the
    message is queued, so no heartbeat after the message contradicts it."""
    from ftrun.rank.client import ControlClient
    from ftrun.rank.recovery import RankProgress

    sent = []

    class FakeChannel:
        def send(self, msg_type, **fields):
            sent.append((msg_type, client.board.phase[0]))

    client = ControlClient(RankProgress())
    client.channel = FakeChannel()
    client.board.begin(0, None)
    client.send(MsgType.FAULT, generation=1, step=0, committed=-1, reason="x", kind="comm")
    client.send(MsgType.RECOVERED, generation=1, role="none", bytes=0, seconds=0.0)
    client.send(MsgType.STEPS_END)
    assert sent == [(MsgType.FAULT, "recovering"), (MsgType.RECOVERED, "compute"), (MsgType.STEPS_END, "done")]


@pytest.mark.parametrize("relayed", [False, True], ids=["direct", "relayed"])
@pytest.mark.parametrize("loss", ["silent", "closed"])
def test_channel_moves_to_the_standby_and_says_hello_again(loss, relayed, capfd):
    """The coordinator's ``standby`` message names a standby and a silence timeout: when the
    coordinator falls silent past it, or its connection closes, the channel connects to the standby
    and says its hello again (``rejoin``, with :attr:`Channel.rejoin_fields`), then beats there:
    a channel whose beats went to its node agent's relay too (the new coordinator may run in that
    agent's process, which relays nothing then)."""
    import time

    import zmq

    from ftrun.common.protocol import FrameAuth
    from ftrun.node.relay import BeatRelay
    from ftrun.rank.channel import Channel

    ctx = zmq.Context.instance()
    coordinator, standby = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for sock in (coordinator, standby):
        sock.setsockopt(zmq.LINGER, 0)
    port = coordinator.bind_to_random_port("tcp://127.0.0.1")
    standby_port = standby.bind_to_random_port("tcp://127.0.0.1")
    relay = BeatRelay(ctx, FrameAuth(TOKEN)) if relayed else None
    channel = Channel(f"tcp://127.0.0.1:{port}", TOKEN, rank=1, incarnation=2, heartbeat_interval=0.05,
                      relay=relay.address if relay is not None else None)
    channel.rejoin_fields = lambda: {"seen": 7}
    try:
        channel.send(MsgType.HELLO, pid=1, generation=0, replica_group=[1], library=True, hot="loop")
        assert coordinator.poll(10_000), "no hello from the channel"
        identity, frame = coordinator.recv_multipart()
        assert decode(frame, Receiver(TOKEN, CONTROL)).type == MsgType.HELLO
        if relay is not None:  # its beats go to the relay, not to the coordinator
            assert relay.sock.poll(10_000), "no beat at the relay"
            relay.drain(time.monotonic())
            assert [row[3] for row in relay.rows(time.monotonic())] == [1]  # sent after its hello
            assert not coordinator.poll(200)
        timeout = 0.3 if loss == "silent" else None
        coordinator.send_multipart([identity, encode(MsgType.STANDBY, Sender(TOKEN), to_peer(identity),
                                                     control=f"tcp://127.0.0.1:{standby_port}", store="s", epoch=1,
                                                     timeout=timeout)])
        deadline = time.monotonic() + 10.0
        while channel.line == [] and time.monotonic() < deadline:
            time.sleep(0.01)  # the I/O thread takes the standby message
        assert channel.line == [f"tcp://127.0.0.1:{standby_port}"] and channel.silence_timeout == timeout
        assert channel.receive() is None  # the standby message stays on the I/O thread
        if loss == "closed":
            coordinator.close()
        assert standby.poll(10_000), "the channel did not move to the standby"
        _, frame = standby.recv_multipart()
        hello = decode(frame, Receiver(TOKEN, CONTROL))
        assert hello.type == MsgType.HELLO and hello["rejoin"] is True and hello["seen"] == 7
        assert (hello["rank"], hello["incarnation"]) == (1, 2) and "hot" not in hello.fields
        assert standby.poll(10_000)
        assert decode(standby.recv_multipart()[1], Receiver(TOKEN, CONTROL)).type == MsgType.HEARTBEAT
        moved = "nothing heard from the coordinator" in capfd.readouterr().err
        assert moved == (loss == "silent")
    finally:
        channel.close()
        coordinator.close()
        standby.close()
        if relay is not None:
            relay.close()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_no_update_is_applied_in_an_nccl_group_once_an_abort_for_a_newer_generation_came(backend):
    """Whatever collective the step ran (ftrun's reducer, FSDP's, the script's own), an abort for a
    newer generation that arrived before the optimizer's update fails the step there in an NCCL
    group: an NCCL collective aborted under it can return without raising (docs/gpu.md). Without an
    abort the same update is applied; so it is in a gloo group, whose cut collectives raise."""
    import threading

    from ftrun.rank.gradsync import GradientSync
    from ftrun.rank.recovery import RankProgress
    from ftrun.rank.workerstate import WorkerState

    class Board:
        def enter(self, phase):
            pass

    class Control:
        def __init__(self):
            self.abandon, self.board = threading.Event(), Board()

    class Group:
        pass

    group = Group()
    group.backend = backend

    class Transaction:
        def before_update(self, optimizer, closure):
            pass

        def after_update(self, applied):
            return applied

    errors, updates, commits = [], [], []
    control = Control()
    sync = GradientSync(1, 30.0, WorkerState(managed=True), RankProgress(committed=4), group, control, None,
                        lambda *a, **k: None, errors.append, lambda error, drop: None, lambda err: False, Transaction())

    def update():
        updates.append(1)
        return "loss"

    assert sync.apply(update, list, commits.append) == (True, "loss") and updates == [1] and commits == [5]
    control.abandon.set()
    if backend == "gloo":
        assert sync.apply(update, list, commits.append) == (True, "loss") and updates == [1, 1] and not errors
        return
    assert sync.apply(update, list, commits.append) == (False, None)
    assert updates == [1] and commits == [5] and errors and errors[0].startswith("abandoned before the update")

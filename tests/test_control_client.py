"""A rank's side of the control plane, without processes: the channel's I/O thread and how the
recovery loop uses the coordinator's messages."""

from __future__ import annotations

from ftrun.protocol import MsgType, decode, encode

TOKEN = "a" * 64


def test_channel_io_thread_survives_a_failing_handler(capfd):
    """An exception in the I/O thread's handler (the worker cuts connections there) must not end the
    thread: the message still reaches the training thread and heartbeats go on."""
    import time

    import zmq

    from ftrun.channel import Channel

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
        assert decode(frame, TOKEN).type == MsgType.HEARTBEAT
        router.send_multipart([identity, encode(MsgType.ABORT, TOKEN, generation=3, reason="test")])
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


def test_recovery_uses_a_plan_taken_with_its_abort(monkeypatch):
    """A plan that arrived right behind its abort (both taken by one poll, before the rank entered
    its recovery loop) is carried out, not dropped: dropping it left the rank waiting for a plan
    that had come, until the coordinator replaced it as hung."""
    from ftrun.worker import Worker

    monkeypatch.setenv("FTRUN_HOT_SPARE", "1")  # a worker without a process group or a channel
    monkeypatch.setenv("WORLD_SIZE", "2")
    worker = Worker("gloo", None, None)
    worker._rank, worker.generation, worker.committed, worker._fresh = 1, 1, 4, False
    sent = []

    class Quiet:
        calls = 0

        def receive(self, timeout=0.0):
            Quiet.calls += 1
            assert Quiet.calls < 3, "the rank waits for a plan it already has"
            return None

        def send(self, msg_type, **fields):
            sent.append((msg_type, fields))

    worker.channel = Quiet()
    worker._drop_group = lambda broken=True: None
    worker._build_group = lambda generation: setattr(worker, "generation", generation) or True
    worker._abort_generation = 2
    worker._plan = decode(encode(MsgType.RECONFIGURE, TOKEN, generation=2, world_size=2, step=4, transfers=[]), TOKEN)
    assert worker._recover(None) == 4
    assert worker.generation == 2 and worker._abort_generation is None
    assert [t for t, _ in sent] == [MsgType.RECOVERED]

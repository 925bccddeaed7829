"""The control-plane wire protocol: authentication, schema checks, what is rejected."""

from __future__ import annotations

import msgpack
import pytest

from ftrun.common.protocol import (
    CONTROL,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    MsgType,
    ProtocolError,
    Receiver,
    Sender,
    decode,
    encode,
    events_for,
    new_token,
    to_peer,
)

TOKEN = "a" * 64


def enc(msg_type: MsgType, token: str = TOKEN, audience: bytes = CONTROL, **fields) -> bytes:
    """A frame of a fresh session (the first of its sender)."""
    return encode(msg_type, Sender(token), audience, **fields)


def dec(frame: bytes, token: str = TOKEN, audience: bytes = CONTROL):
    """Decode at a fresh endpoint (no session seen yet)."""
    return decode(frame, Receiver(token, audience))


def test_protocol_round_trip():
    token = new_token()
    assert len(token) == 64 and token != new_token()
    frame = enc(MsgType.HELLO, token, rank=1, incarnation=0, pid=123, generation=0, replica_group=[0, 1],
                library=True, extra="kept")
    msg = dec(frame, token)
    assert msg.type == MsgType.HELLO
    assert msg["rank"] == 1 and msg["replica_group"] == [0, 1] and msg["library"] is True
    assert msg.get("extra") == "kept" and msg.get("absent", 7) == 7
    assert "v" not in msg.fields and "tok" not in msg.fields and "type" not in msg.fields


def test_protocol_round_trip_every_type():
    samples = {
        MsgType.HEARTBEAT: dict(rank=0, incarnation=1),
        MsgType.PROGRESS: dict(rank=0, incarnation=1, step=3, metrics={"loss": 0.5}),
        MsgType.FAULT: dict(rank=0, incarnation=1, generation=2, step=3, committed=2, reason="x"),
        MsgType.RECOVERED: dict(rank=0, incarnation=1, generation=2, role="donor", bytes=10, seconds=1),
        MsgType.RECONFIGURE: dict(generation=1, world_size=4, step=9, transfers=[[0, 1]]),
        MsgType.EVENT: dict(event={"kind": "job_started"}),
        MsgType.STATUS: dict(ranks=[]),
    }
    for msg_type, fields in samples.items():
        msg = dec(enc(msg_type, **fields))
        assert msg.type == msg_type and msg.fields == fields


def raw(**data) -> bytes:
    """A frame signed with the right secret (tests what is checked after authentication)."""
    return Sender(TOKEN).seal(msgpack.packb(data, use_bin_type=True), CONTROL)


def signed(payload: bytes) -> bytes:
    return Sender(TOKEN).seal(payload, CONTROL)


_GOOD = enc(MsgType.HEARTBEAT, rank=0, incarnation=0)
_HB = msgpack.packb({"v": PROTOCOL_VERSION, "type": "heartbeat", "rank": 0, "incarnation": 0})

REJECT_CASES = [
    # authentication: checked before anything is decoded
    (enc(MsgType.HEARTBEAT, "b" * 64, rank=0, incarnation=0), "authentication"),
    (enc(MsgType.HEARTBEAT, audience=to_peer(b"r123"), rank=0, incarnation=0), "another endpoint"),
    (enc(MsgType.HEARTBEAT, audience=events_for(0), rank=0, incarnation=0), "another endpoint"),
    (msgpack.packb({"v": 1, "tok": TOKEN, "type": "heartbeat", "rank": 0, "incarnation": 0}), "authentication"),
    (b"\x00" * 56 + _HB, "authentication"),
    (_GOOD[:-1] + bytes([_GOOD[-1] ^ 1]), "authentication"),  # one bit of the payload altered
    (bytes([_GOOD[0] ^ 1]) + _GOOD[1:], "authentication"),  # one bit of the tag altered
    (_GOOD[:40] + bytes([_GOOD[40] ^ 1]) + _GOOD[41:], "authentication"),  # the session altered
    (_GOOD[:55] + bytes([_GOOD[55] ^ 2]) + _GOOD[56:], "authentication"),  # the counter altered
    (_GOOD + b"x", "authentication"),  # trailing bytes are not covered by the tag
    (b"garbage", "too short"),
    (b"", "too short"),
    (b"\x00" * 56, "too short"),
    (b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds"),
    (raw(v=PROTOCOL_VERSION, type="status", ranks=["x" * MAX_FRAME_BYTES]), "exceeds"),
    # signed, but not a valid message
    (raw(v=1, tok=TOKEN, type="heartbeat", rank=0, incarnation=0), "version"),
    (raw(type="heartbeat", rank=0, incarnation=0), "version"),
    (raw(v="2", type="heartbeat", rank=0, incarnation=0), "version"),
    (raw(v=PROTOCOL_VERSION, type="launch_missiles"), "unknown message type"),
    (raw(v=PROTOCOL_VERSION, rank=0), "unknown message type"),
    (raw(v=PROTOCOL_VERSION, type="heartbeat", rank=0), "missing field 'incarnation'"),
    (raw(v=PROTOCOL_VERSION, type="heartbeat", rank="0", incarnation=0), "type str"),
    (raw(v=PROTOCOL_VERSION, type="heartbeat", rank=0.0, incarnation=0), "type float"),
    (raw(v=PROTOCOL_VERSION, type="heartbeat", rank=True, incarnation=0), "type bool"),
    (raw(v=PROTOCOL_VERSION, type="heartbeat", rank=None, incarnation=0), "type NoneType"),
    (raw(v=PROTOCOL_VERSION, type="progress", rank=0, incarnation=0, step=1, metrics=[1]), "metrics"),
    (raw(v=PROTOCOL_VERSION, type="recovered", rank=0, incarnation=0, generation=1, role="x",
         bytes=1, seconds=False), "type bool"),
    (signed(msgpack.packb([1, 2, 3])), "not a map"),
    (signed(msgpack.packb("heartbeat")), "not a map"),
    (signed(b"\xc1"), "not msgpack"),
    (signed(b"\x92\x01"), "not msgpack"),  # truncated array
    (signed(msgpack.packb({"v": 2}) + b"trailing"), "not msgpack"),
    (signed(bytes(range(256)) * 4), "not msgpack"),
    (signed(msgpack.packb({1: 2})), "not msgpack"),  # non-string map key
]


def test_frames_never_carry_the_secret():
    frame = enc(MsgType.ABORT, generation=1, reason="x")
    assert TOKEN.encode() not in frame and b"tok" not in frame


@pytest.mark.parametrize("frame, hint", REJECT_CASES, ids=[f"{i}-{h.split()[0]}" for i, (_, h) in enumerate(REJECT_CASES)])
def test_protocol_rejects(frame, hint):
    with pytest.raises(ProtocolError, match=hint):
        dec(frame)


def test_protocol_error_is_value_error():
    assert issubclass(ProtocolError, ValueError)


def test_encode_checks_fields():
    with pytest.raises(ProtocolError, match="missing field 'step'"):
        enc(MsgType.PROGRESS, rank=0, incarnation=0, metrics={})
    with pytest.raises(ProtocolError, match="type bool"):
        enc(MsgType.PROGRESS, rank=0, incarnation=0, step=False, metrics={})


@pytest.mark.parametrize("version", [True, 1.0])
def test_protocol_rejects_non_int_version(version):
    frame = raw(v=version, type="heartbeat", rank=0, incarnation=0)
    with pytest.raises(ProtocolError, match="version"):
        dec(frame)



def test_a_replayed_or_reordered_frame_is_rejected_and_changes_nothing():
    """Freshness: each session's counters are accepted once, in increasing order; another session
    (a new connection, a respawned rank) starts its own count."""
    sender, receiver = Sender(TOKEN), Receiver(TOKEN, CONTROL)
    frames = [encode(MsgType.HEARTBEAT, sender, CONTROL, rank=0, incarnation=0) for _ in range(3)]
    assert decode(frames[0], receiver).type == MsgType.HEARTBEAT
    with pytest.raises(ProtocolError, match="stale frame"):
        decode(frames[0], receiver)  # replayed
    assert decode(frames[2], receiver).type == MsgType.HEARTBEAT
    with pytest.raises(ProtocolError, match="stale frame"):
        decode(frames[1], receiver)  # overtaken: delivered out of order
    with pytest.raises(ProtocolError, match="stale frame"):
        decode(frames[2], receiver)
    other = Sender(TOKEN)
    assert other.session != sender.session
    assert decode(encode(MsgType.HEARTBEAT, other, CONTROL, rank=1, incarnation=0), receiver)["rank"] == 1
    assert decode(encode(MsgType.HEARTBEAT, sender, CONTROL, rank=0, incarnation=0), receiver)["rank"] == 0


def test_a_frame_for_one_endpoint_does_not_verify_at_another():
    sender = Sender(TOKEN)
    frame = encode(MsgType.ABORT, sender, to_peer(b"r-one"), generation=1, reason="x")
    assert decode(frame, Receiver(TOKEN, to_peer(b"r-one")))["generation"] == 1
    for audience in (to_peer(b"r-two"), CONTROL, events_for(0)):
        with pytest.raises(ProtocolError, match="another endpoint"):
            decode(frame, Receiver(TOKEN, audience))


def test_standby_line_reads_the_seats_first_first_and_an_older_message_s_control() -> None:
    from ftrun.common.protocol import Message, MsgType, standby_line

    line = Message(MsgType.STANDBY, {"control": "tcp://a:1", "store": "a:2", "epoch": 0,
                                     "seats": [["tcp://a:1", 1], ["tcp://b:1", 2], ["bad"], [3, 4], ["tcp://c:1", True]]})
    assert standby_line(line) == [("tcp://a:1", 1), ("tcp://b:1", 2)]
    assert standby_line(Message(MsgType.STANDBY, {"control": "tcp://a:1", "store": "", "epoch": 0})) == [("tcp://a:1", -1)]
    assert standby_line(Message(MsgType.STANDBY, {"control": "", "store": "", "epoch": 0, "seats": []})) == []


def test_an_endpoint_nothing_listens_on_refuses_and_a_bound_one_does_not() -> None:
    import socket

    from ftrun.common.protocol import endpoint_refuses

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not endpoint_refuses(f"tcp://127.0.0.1:{port}")
    assert endpoint_refuses(f"tcp://127.0.0.1:{port}")  # closed: the kernel answers with a reset
    assert not endpoint_refuses("tcp://not-an-endpoint")  # not proof of anything

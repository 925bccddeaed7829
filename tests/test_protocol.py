"""The control-plane wire protocol: authentication, schema checks, what is rejected."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from ftrun.common.messages import BODIES, Hello, accepted_types
from ftrun.common.protocol import (
    CONTROL,
    FIELD_TYPES,
    REQUIRED,
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
    frame = enc(MsgType.HELLO, token, rank=1, incarnation=0, pid=123, generation=0, replica_group=[0, 1], library=True)
    msg = dec(frame, token)
    assert msg.type == MsgType.HELLO
    assert msg["rank"] == 1 and msg["replica_group"] == [0, 1] and msg["library"] is True
    assert msg.get("hot") is None and msg.get("absent", 7) == 7 and "hot" not in msg.fields
    assert msg.body == Hello(rank=1, incarnation=0, pid=123, generation=0, replica_group=[0, 1], library=True)
    assert msg.body.hot is None and msg.body.rejoin is None
    assert "v" not in msg.fields and "tok" not in msg.fields and "type" not in msg.fields


#: One message of each type with every field its body has, optional ones included.
FULL = {
    MsgType.HELLO: dict(rank=0, incarnation=1, pid=9, generation=2, replica_group=[0, 1], library=True,
                        hot="the training loop", rejoin=True, seen=3),
    MsgType.HEARTBEAT: dict(rank=0, incarnation=1, in_dist=False, stage="loop", stage_bytes=0, phase="compute",
                            phase_age=0.5, committed=4, step=5, total=100, last_step=0.1, compute=0.05, samples=7,
                            step_times=[0.1, 0.2], step_max=0.3, step_max_from=1, sent=3),
    MsgType.PROGRESS: dict(rank=0, incarnation=1, step=3, metrics={"loss": 0.5}, section="eval", section_timeout=30.0),
    MsgType.FAULT: dict(rank=0, incarnation=1, generation=2, step=3, committed=2, reason="x", kind="comm", rollback=True),
    MsgType.RECOVERED: dict(rank=0, incarnation=1, generation=2, role="donor", bytes=10, seconds=1.5,
                            rebuild_seconds=0.2),
    MsgType.STEPS_END: dict(rank=0, incarnation=1),
    MsgType.DONE: dict(rank=0, incarnation=1, committed=99),
    MsgType.ERROR: dict(rank=0, incarnation=1, reason="disk full", checkpoint=40),
    MsgType.DIVERGENCE: dict(rank=0, incarnation=1, step=3, check="gradient", reason="differs"),
    MsgType.RECONFIGURE: dict(generation=1, world_size=4, step=9, transfers=[[0, 1]], store="h:1", rollback="/ck/9"),
    MsgType.ABORT: dict(generation=1, reason="rank 1 died"),
    MsgType.SAVE: dict(generation=1, step=9, shard=0, directory="/ck/9", reason="dying gasp"),
    MsgType.SAVED: dict(rank=0, incarnation=1, step=9, shard=0, info={"file": "s0"}, seconds=0.5,
                        torch_version="2.4.0", reason="periodic"),
    MsgType.FINISHED: dict(),
    MsgType.EVENT: dict(event={"kind": "job_started"}),
    MsgType.STATUS: dict(ranks=[{"rank": 0}], attempt=0, generation=1),
    MsgType.AGENT_HELLO: dict(node=1, pid=7, host="h1", standby_control="tcp://h1:2", standby_store="h1:3",
                              sees_checkpoint_dir=True, record_store="h1:4"),
    MsgType.AGENT_BEAT: dict(node=1, leaving="SIGTERM", standby_control="tcp://h1:2", standby_store="h1:3",
                             ranks=[[2, 0, 0.25, 3, {"phase": "compute", "step": 5}]]),
    MsgType.SPAWN: dict(rank=2, incarnation=1, vars={"RANK": "2"}, header="== rank 2 ==", use_spare=False),
    MsgType.SPAWNED: dict(node=1, rank=2, incarnation=1, pid=70, spare=True, spare_kind="hot"),
    MsgType.EXITED: dict(node=1, rank=2, incarnation=1, pid=70, returncode=-9, at=1700000000.5, error="ValueError: x",
                         log_tail=["Traceback"]),
    MsgType.STOPPED: dict(node=1, rank=2, incarnation=1, pid=70, signal=19, at=1700000000.5),
    MsgType.SIGNAL: dict(rank=2, incarnation=1, signal=15),
    MsgType.KILL_HUNG: dict(rank=2, incarnation=1, line="hung: {note}", dump=True),
    MsgType.STACKS: dict(node=1, rank=2, incarnation=1, lines=["Thread 1"], note="dumped"),
    MsgType.STOP_RANKS: dict(grace=5.0),
    MsgType.SPARES: dict(warm=1, hot=0, vars={"MODEL": "x"}),
    MsgType.SPARE_NOTE: dict(node=1, message="set-up reads RANK"),
    MsgType.SHUTDOWN: dict(code=0, message="done", rejoin=False),
    MsgType.TAKE_NODE: dict(node=0),
    MsgType.STANDBY: dict(control="tcp://h1:2", store="h1:3", epoch=0, seats=[["tcp://h1:2", 1]], timeout=15.0),
    MsgType.STATE: dict(state={"epoch": 0, "groups": [[0, 1]], "ranks": [[0, 0, 10, True, 0, 0, "healthy", 4, True]]}),
    MsgType.STAND_BY: dict(),
    MsgType.RANK_ORDERS: dict(node=1, order="abort", common={"generation": 2, "reason": "rank 3 died"}, ranks=[[2, 0, {}]]),
    MsgType.RANK_REPORTS: dict(node=1, reports=[["recovered", {"rank": 2, "incarnation": 0, "generation": 2,
                                                               "role": "none", "bytes": 0, "seconds": 0.0}]]),
}


def test_every_message_type_has_a_frozen_dataclass_body():
    assert set(BODIES) == set(MsgType) == set(FULL)
    for msg_type, body in BODIES.items():
        assert dataclasses.is_dataclass(body) and body.__dataclass_params__.frozen, msg_type
        assert set(FIELD_TYPES[msg_type]) == {f.name for f in dataclasses.fields(body)}
        assert set(FULL[msg_type]) == set(FIELD_TYPES[msg_type]), f"{msg_type.value}: the sample lacks a field"


@pytest.mark.parametrize("msg_type", list(MsgType), ids=lambda t: t.value)
def test_each_type_round_trips_with_its_optional_fields(msg_type):
    fields = FULL[msg_type]
    msg = dec(enc(msg_type, **fields))
    assert msg.type == msg_type and msg.fields == fields
    assert msg.body == BODIES[msg_type](**fields)
    assert all(getattr(msg.body, name) == value for name, value in fields.items())
    required = {name: fields[name] for name in REQUIRED[msg_type]}
    bare = dec(enc(msg_type, **required))  # the optional fields may be left out: None in the body
    assert bare.fields == required
    assert all(getattr(bare.body, name) is None for name in set(fields) - set(required))


@pytest.mark.parametrize("msg_type", list(MsgType), ids=lambda t: t.value)
def test_an_unknown_field_is_rejected_on_both_sides(msg_type):
    frame = raw(v=PROTOCOL_VERSION, type=msg_type.value, **FULL[msg_type], bogus=1)
    with pytest.raises(ProtocolError, match=f"{msg_type.value}: unknown field 'bogus'"):
        dec(frame)
    with pytest.raises(ProtocolError, match="unknown field 'rnak'"):  # a sender's typo
        enc(msg_type, **FULL[msg_type], rnak=0)


REQUIRED_CASES = [(t, name) for t in MsgType for name in REQUIRED[t]]


@pytest.mark.parametrize("msg_type, name", REQUIRED_CASES, ids=[f"{t.value}-{n}" for t, n in REQUIRED_CASES])
def test_a_missing_required_field_is_rejected(msg_type, name):
    fields = {k: v for k, v in FULL[msg_type].items() if k != name}
    with pytest.raises(ProtocolError, match=f"missing field '{name}'"):
        dec(raw(v=PROTOCOL_VERSION, type=msg_type.value, **fields))


def _wrong(types: tuple[type, ...]) -> list:
    """Values of a type a field accepting ``types`` refuses."""
    candidates = [True, 3, 2.5, "x", [1], {"k": 1}, None]
    return [v for v in candidates if not isinstance(v, types) or (isinstance(v, bool) and bool not in types)]


TYPE_CASES = [(t, name, value) for t in MsgType for name, types in FIELD_TYPES[t].items() for value in _wrong(types)]


@pytest.mark.parametrize("msg_type, name, value", TYPE_CASES,
                         ids=[f"{t.value}-{n}-{type(v).__name__}" for t, n, v in TYPE_CASES])
def test_a_field_of_the_wrong_type_is_rejected(msg_type, name, value):
    fields = {**FULL[msg_type], name: value}
    with pytest.raises(ProtocolError, match=f"field '{name}' has type {type(value).__name__}"):
        dec(raw(v=PROTOCOL_VERSION, type=msg_type.value, **fields))


def test_accepted_types_keep_the_wire_s_semantics():
    """A float field takes an int; an int field neither a bool nor a float; a bool field not an
    int; an optional field takes None (not sent, or sent as None: both are a body's None)."""
    base = dict(rank=0, incarnation=0, generation=1, role="none", bytes=0)
    assert dec(enc(MsgType.RECOVERED, **base, seconds=2))["seconds"] == 2
    with pytest.raises(ProtocolError, match="'bytes' has type float"):
        enc(MsgType.RECOVERED, **{**base, "bytes": 1.0}, seconds=0.0)
    with pytest.raises(ProtocolError, match="'library' has type int"):
        enc(MsgType.HELLO, rank=0, incarnation=0, pid=1, generation=0, replica_group=[], library=1)
    closed = dec(enc(MsgType.PROGRESS, rank=0, incarnation=0, step=1, metrics={}, section=None))
    assert "section" in closed.fields and closed.body.section is None
    assert accepted_types(float) == (int, float) and accepted_types(int | None) == (int, type(None))
    assert accepted_types(list[list[int]]) == (list,) and accepted_types(dict[str, str] | None) == (dict, type(None))
    with pytest.raises(TypeError):
        accepted_types(tuple[int, int])


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


def test_a_value_of_a_subclass_is_looked_at_closely():
    """Fields are checked by their value's exact type first; a subclass of an accepted type (an
    IntEnum, say) passes the closer look, a bool never passes for an int, and a missing field is
    named in the body's order."""
    import enum

    class Number(enum.IntEnum):
        ONE = 1

    base = dict(incarnation=0, generation=1, role="none", bytes=0, seconds=0.0)
    assert dec(enc(MsgType.RECOVERED, rank=Number.ONE, **base))["rank"] == 1
    with pytest.raises(ProtocolError, match="'rank' has type bool"):
        enc(MsgType.RECOVERED, rank=True, **base)
    with pytest.raises(ProtocolError, match="missing field 'incarnation'"):
        enc(MsgType.RECOVERED, rank=0, **{k: v for k, v in base.items() if k not in ("incarnation", "role")})


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

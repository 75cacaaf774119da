"""Instance records: strict structuring and the address routers know an instance by."""

from __future__ import annotations

import attrs
import pytest

from pd_fsm.io_trio.bootstrap.records import (
    RecordError,
    parse_key,
    parse_record,
    split_host_port,
    to_json,
    unreachable_fields,
)
from pd_fsm.io_trio.side_channel.channel import zmq_endpoint
from tests.support.io_doubles import sample_record


def test_round_trip_and_key() -> None:
    record = sample_record(tp_rank=1, tp_size=2, mesh_meta={"axes": ["tp"], "shape": [2]})
    assert parse_record(to_json(record)) == record
    assert record.key == ("prefill", "p0", 1, 0, 0, 0)
    fields = ("role", "instance_id", "tp_rank", "cp_rank", "dp_rank", "pp_rank")
    assert parse_key({k: to_json(record)[k] for k in fields}).key == record.key


def test_advertised_defaults_to_the_side_channel_address() -> None:
    assert sample_record(zmq_addr="tcp://10.1.2.3:5000").advertised == "10.1.2.3:5000"
    assert sample_record(bootstrap_port=8998).advertised == "127.0.0.1:8998"
    r = sample_record(bootstrap_host="p.example", bootstrap_port=8998)
    assert r.advertised == "p.example:8998"


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("tcp://h:1", ("h", 1)),
        ("[::1]:9000", ("::1", 9000)),
    ],
)
def test_split_host_port(addr: str, expected: tuple[str, int]) -> None:
    assert split_host_port(addr) == expected


@pytest.mark.parametrize("addr", ["h", ":80", "h:", "h:x", "h:0", "h:65536", "h:-1"])
def test_split_host_port_refuses(addr: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(addr)


def test_role_epoch_is_an_integer_from_0() -> None:
    """A worker's role switches so far (issue 30 §1): 0 when absent, strict otherwise."""
    body = to_json(sample_record())
    assert body["role_epoch"] == 0
    del body["role_epoch"]  # a record from before role switches
    assert parse_record(body).role_epoch == 0
    assert parse_record({**body, "role_epoch": 7}).role_epoch == 7
    for bad, said in (("1", "role_epoch"), (True, "role_epoch"), (1.0, "role_epoch"),
                      (-1, "role_epoch must be >= 0")):
        with pytest.raises(RecordError, match=said):
            parse_record({**body, "role_epoch": bad})


def test_every_problem_is_reported_at_once() -> None:
    body = to_json(sample_record())
    body.update(role="x", tp_rank=3, tp_size=2, dp_rank=-1, page_size=0, zmq_addr="nope")
    with pytest.raises(RecordError) as err:
        parse_record(body)
    text = str(err.value)
    for needle in ("unknown role", "tp_rank 3", "dp_rank must be >= 0", "page_size", "zmq_addr"):
        assert needle in text


def test_key_body_is_strict() -> None:
    with pytest.raises(RecordError, match="extra fields"):
        parse_key(
            {
                "role": "decode",
                "instance_id": "d",
                "tp_rank": 0,
                "cp_rank": 0,
                "dp_rank": 0,
                "pp_rank": 0,
                "tp_size": 1,
            }
        )
    with pytest.raises(RecordError, match="must be a JSON object"):
        parse_key("prefill")


def test_zmq_endpoint() -> None:
    assert zmq_endpoint("127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert zmq_endpoint("ipc:///tmp/x") == "ipc:///tmp/x"


def test_addresses_a_peer_could_not_dial_are_named() -> None:
    record = attrs.evolve(sample_record(), transfer_addr="0.0.0.0:7001",
                          zmq_addr="tcp://10.0.0.1:7002", scheduler_addr="http://[::]:30000")
    assert unreachable_fields(record, None) == [
        ("transfer_addr", "advertises the wildcard address 0.0.0.0, which no peer can dial"),
        ("scheduler_addr", "advertises the wildcard address ::, which no peer can dial"),
    ]
    loop = sample_record()  # 127.0.0.1 everywhere: fine from loopback, not from another host
    assert unreachable_fields(loop, "127.0.0.1") == []
    assert [name for name, _ in unreachable_fields(loop, "10.77.0.2")] == [
        "transfer_addr", "zmq_addr"
    ]

"""Bind one address, advertise another: what a worker may tell its peers."""

from __future__ import annotations

import re

import pytest

from pd_fsm.io_trio.bootstrap.addresses import (
    AddressError,
    advertised_host,
    interface_address,
    is_loopback,
    is_wildcard,
    unreachable_from,
)
from pd_fsm.io_trio.worker.config import add_serve_arguments, config_from_args


def test_classification() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "", "[::]"))
    assert not is_wildcard("10.0.0.1")
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.5.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("10.77.0.1", "p.example", "0.0.0.0"))


def test_the_loopback_interface_has_its_address() -> None:
    assert interface_address("lo") == "127.0.0.1"  # every Linux machine has it


@pytest.mark.parametrize("name", ["no-such-if0", "", "x" * 20])
def test_an_unknown_interface_is_named(name: str) -> None:
    with pytest.raises(AddressError, match="--advertise-interface"):
        interface_address(name)


def test_advertised_host_rules() -> None:
    assert advertised_host("127.0.0.1", None, None) == "127.0.0.1"  # the default stays loopback
    assert advertised_host("10.77.0.1", None, None, registry_host="10.77.0.1") == "10.77.0.1"
    assert advertised_host("0.0.0.0", "10.77.0.2", None, registry_host="10.77.0.1") == "10.77.0.2"
    assert advertised_host("0.0.0.0", None, "lo") == "127.0.0.1"
    with pytest.raises(AddressError, match=re.escape("--host 0.0.0.0 binds every interface")):
        advertised_host("0.0.0.0", None, None)
    with pytest.raises(AddressError, match="--advertise-host binds every interface"):
        advertised_host("10.0.0.1", "0.0.0.0", None)
    with pytest.raises(AddressError, match="contradict"):
        advertised_host("0.0.0.0", "10.0.0.1", "lo")
    with pytest.raises(AddressError, match=re.escape("127.0.0.1 to the bootstrap server on 10.")):
        advertised_host("127.0.0.1", None, None, registry_host="10.77.0.1")
    with pytest.raises(AddressError, match=re.escape("advertise 127.0.0.1 to the bootstrap")):
        advertised_host("0.0.0.0", None, "lo", registry_host="10.77.0.1")


def test_unreachable_from() -> None:
    assert unreachable_from("10.77.0.1", "10.77.0.2") is None
    assert unreachable_from("127.0.0.1", "127.0.0.1") is None
    assert unreachable_from("127.0.0.1", None) is None
    assert "wildcard" in (unreachable_from("0.0.0.0", "127.0.0.1") or "")
    assert "registered from 10.77.0.2" in (unreachable_from("127.0.0.1", "10.77.0.2") or "")


def _config(*argv: str) -> object:
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_serve_flags() -> None:
    c = _config("--disaggregation-mode", "prefill", "--host", "0.0.0.0",
                "--advertise-host", "10.77.0.1", "--disaggregation-bootstrap-host", "10.77.0.1")
    assert (c.host, c.public_host) == ("0.0.0.0", "10.77.0.1")  # type: ignore[attr-defined]
    plain = _config("--disaggregation-mode", "decode")
    assert plain.public_host == "127.0.0.1"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=re.escape("--host 0.0.0.0 binds every interface")):
        _config("--disaggregation-mode", "decode", "--host", "0.0.0.0")
    with pytest.raises(ValueError, match=re.escape("would advertise 127.0.0.1 to the")):
        _config("--disaggregation-mode", "decode", "--disaggregation-bootstrap-host", "10.0.0.1")
    colocated = _config("--host", "0.0.0.0")  # advertises nothing: any bind address is fine
    assert colocated.public_host == "0.0.0.0"  # type: ignore[attr-defined]

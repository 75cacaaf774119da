"""`pd-fsm switch-role` and `pd-fsm serve --roles`: their argument errors, each naming the
argument (the switch itself is in tests/integration/test_role_switch.py)."""

from __future__ import annotations

import argparse

import pytest
import trio

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.ports import free_port
from pd_fsm.io_trio.worker.config import add_serve_arguments, config_from_args
from pd_fsm.io_trio.worker.switch_cli import switch_role


@pytest.mark.parametrize(("argv", "said"), [
    (["switch-role", "127.0.0.1:30000", "decode"], "URL must be http://HOST:PORT"),
    (["switch-role", "unix:/tmp/a:b.sock", "decode"], "may not contain ':'"),
    (["switch-role", "http://h:1", "colocated"], "invalid choice: 'colocated'"),
    (["switch-role", "http://h:1", "decode", "--wait", "-1"], "--wait must be >= 0"),
    (["switch-role", "http://h:1", "decode", "--wait", "nan"], "--wait must be >= 0"),
    (["switch-role", "http://h:1"], "the following arguments are required: ROLE"),
])
def test_switch_role_argument_errors(argv: list[str], said: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser(argv).parse_args(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_switch_role_names_a_worker_it_cannot_reach() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, said = trio.run(switch_role, url, "decode", None, 1.0)
    assert code == 1 and f"cannot reach {url}" in said


def _serve(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_serve_roles() -> None:
    config = config_from_args(_serve(["--disaggregation-mode", "prefill",
                                      "--roles", "decode,prefill"]))
    assert config.role_list == ("prefill", "decode")  # the starting role first
    assert config_from_args(_serve([])).role_list == ("null",)
    with pytest.raises(ValueError, match="must include --disaggregation-mode's role"):
        config_from_args(_serve(["--roles", "prefill,decode"]))
    with pytest.raises(ValueError, match="not supported with --nnodes > 1"):
        config_from_args(_serve(["--roles", "null,decode", "--nnodes", "2", "--tp", "2",
                                 "--dist-init-addr", "127.0.0.1:29500"]))


@pytest.mark.parametrize(("value", "said"), [
    ("prefill,colocated", "unknown role(s) 'colocated'"),
    ("decode,decode", "a role is named twice"),
])
def test_serve_roles_errors(value: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve(["--roles", value])
    assert said in capsys.readouterr().err

"""The core's types are its contract with embedders: a wrong event or an unhandled effect is a
type error. Checked with mypy itself, on small programs that use the public API."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mypy import api

HEADER = """
import random
from typing import assert_never
from pd_fsm.core import DecodeEndpoint, PrefillEndpoint
from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
p = PrefillEndpoint("layout", rng=random.Random(1))
d = DecodeEndpoint(identity="d0", layout_hash="layout")
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: the first run analyses pd_fsm.core, the others reuse it."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, body: str) -> tuple[str, int]:
    out, err, status = api.run(["--strict", "--no-error-summary", f"--cache-dir={cache}",
                                "-c", HEADER + textwrap.dedent(body)])
    return out + err, status


def test_a_correct_embedding_checks(cache: Path) -> None:
    out, status = _mypy(cache, """
        effects: list[fx.PrefillEffect] = p.handle(ev.PrefillRequestAccepted(1), 0.0)
        for e in effects:
            match e:
                case fx.SendMessage() | fx.RegisterKV() | fx.NarrowKV() | fx.ReleaseKV():
                    pass
                case fx.CompleteRequest() | fx.FailRequest() | fx.RejectRequest():
                    pass
                case fx.AckWhileBusy():
                    pass
                case _:
                    assert_never(e)
        d_effects: list[fx.DecodeEffect] = d.handle(ev.TimeAdvanced(), 0.0)
    """)
    assert status == 0, out


def test_a_decode_event_given_to_p_is_a_type_error(cache: Path) -> None:
    out, status = _mypy(cache, """
        p.handle(ev.PullSucceeded(1), 0.0)
    """)
    assert status == 1 and 'incompatible type "PullSucceeded"' in out, out


def test_a_forgotten_effect_is_a_type_error(cache: Path) -> None:
    out, status = _mypy(cache, """
        for e in p.handle(ev.TimeAdvanced(), 0.0):
            match e:
                case fx.SendMessage() | fx.RegisterKV() | fx.NarrowKV() | fx.ReleaseKV():
                    pass
                case fx.CompleteRequest() | fx.FailRequest():
                    pass
                case _:
                    assert_never(e)
    """)
    assert status == 1 and "RejectRequest" in out, out

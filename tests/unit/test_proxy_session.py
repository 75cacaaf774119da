"""What the proxy reads of a request's ProxySession (table proxy_session), state by state: the
answers its relay code gives instead of the flags the session used to carry."""

from __future__ import annotations

import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.session import ProxySession
from pd_fsm.core.tables import PROXY_SESSION

_S = PROXY_SESSION.S

# state: (headers_sent, stream_whole, answered, gone) — the old flags headers_sent, sse_done,
# relay_finished and client_gone, read from the one state.
VIEWS = {
    _S.SILENT: (False, False, False, False),
    _S.STREAMING: (True, False, False, False),
    _S.STREAM_WHOLE: (True, True, False, False),
    _S.ANSWERED: (True, False, True, False),
    _S.CLOSED: (True, False, True, False),
    _S.GONE: (False, False, False, True),
}
PATHS: dict[str, list[ev.SessionEvent]] = {
    _S.SILENT: [],
    _S.STREAMING: [ev.HeadersSent(), ev.ChunkRelayed()],
    _S.STREAM_WHOLE: [ev.HeadersSent(), ev.ChunkRelayed(), ev.DoneRelayed()],
    _S.ANSWERED: [ev.HeadersSent(), ev.DoneRelayed(), ev.AnswerRelayed()],
    _S.CLOSED: [ev.ErrorAnswered(), ev.ClientLeft()],
    _S.GONE: [ev.ClientLeft()],
}


def test_every_state_has_its_views() -> None:
    assert set(VIEWS) == set(PROXY_SESSION.states) == set(PATHS)


@pytest.mark.parametrize("state", list(VIEWS))
def test_views_of_each_state(state: str) -> None:
    s = ProxySession()
    for event in PATHS[state]:
        s.handle(event, 0.0)
    assert s.state == state
    assert (s.headers_sent, s.stream_whole, s.answered, s.gone) == VIEWS[state]


def test_a_stream_reports_its_end_once_and_a_later_disconnect_is_no_client_leaving() -> None:
    s = ProxySession()
    assert s.handle(ev.HeadersSent(), 0.0) == []
    assert s.handle(ev.DoneRelayed(), 0.0) == []
    assert s.handle(ev.AnswerRelayed(), 0.0) == [fx.ReportRelayFinished()]
    assert s.handle(ev.ClientLeft(), 0.0) == []  # the connection's end after a whole answer
    assert s.state == _S.CLOSED
    assert s.next_deadline() is None


def test_a_client_leaving_mid_stream_is_reported_and_late_sends_are_quiet() -> None:
    s = ProxySession()
    s.handle(ev.HeadersSent(), 0.0)
    assert s.handle(ev.ClientLeft(), 0.0) == [fx.ReportDisconnect()]
    assert s.handle(ev.ChunkRelayed(), 0.0) == []  # a send racing the cancellation
    assert s.handle(ev.AnswerRelayed(), 0.0) == []  # no RelayFinished for a CANCELLED room
    with pytest.raises(LocalProtocolError):
        s.handle(ev.ClientLeft(), 0.0)  # reported once


def test_a_second_status_line_is_our_bug() -> None:
    s = ProxySession()
    s.handle(ev.HeadersSent(), 0.0)
    with pytest.raises(LocalProtocolError, match="STREAMING has no row for HeadersSent"):
        s.handle(ev.HeadersSent(), 0.0)

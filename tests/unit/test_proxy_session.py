"""What the proxy reads of a request's ProxySession (table proxy_session), state by state: the
answers its relay code gives instead of the flags the session used to carry; and of a split
n > 1 answer's sequences, each a SequenceSession (table proxy_sequence), which replaced the
proxy's ``apart`` and ``part`` flags."""

from __future__ import annotations

import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.session import ProxySession, SequenceSession
from pd_fsm.core.tables import PROXY_SEQUENCE, PROXY_SESSION

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
    _S.SPLIT: (True, False, False, False),
    _S.SPLIT_ENDED: (True, False, False, False),
}
PATHS: dict[str, list[ev.SessionEvent]] = {
    _S.SILENT: [],
    _S.STREAMING: [ev.HeadersSent(), ev.ChunkRelayed()],
    _S.STREAM_WHOLE: [ev.HeadersSent(), ev.ChunkRelayed(), ev.DoneRelayed()],
    _S.ANSWERED: [ev.HeadersSent(), ev.DoneRelayed(), ev.AnswerRelayed()],
    _S.CLOSED: [ev.ErrorAnswered(), ev.ClientLeft()],
    _S.GONE: [ev.ClientLeft()],
    _S.SPLIT: [ev.HeadersSent(), ev.ChunkRelayed(), ev.AnswerSplit((0, 1))],
    _S.SPLIT_ENDED: [ev.HeadersSent(), ev.AnswerSplit((1,)), ev.SequenceEnded(1)],
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


def test_a_split_answer_waits_for_each_sequence_and_reports_nothing_for_its_old_room() -> None:
    """The answer ends only once every sequence it split into has ended (in any order), and
    its end reports no RelayFinished: the room it broke in is over (MIGRATED)."""
    s = ProxySession()
    s.handle(ev.HeadersSent(), 0.0)
    assert s.handle(ev.AnswerSplit((0, 2, 3)), 0.0) == []
    s.handle(ev.ChunkRelayed(), 0.0)
    s.handle(ev.SequenceEnded(2), 0.0)
    with pytest.raises(LocalProtocolError, match="sequence 2 is not running"):
        s.handle(ev.SequenceEnded(2), 0.0)  # ended once
    with pytest.raises(LocalProtocolError, match="SPLIT has no row for AnswerRelayed"):
        s.handle(ev.AnswerRelayed(), 0.0)  # sequence 0 and 3 still run
    s.handle(ev.SequenceEnded(0), 0.0)
    assert s.state == _S.SPLIT
    s.handle(ev.SequenceEnded(3), 0.0)
    assert s.state == _S.SPLIT_ENDED
    s.handle(ev.ChunkRelayed(), 0.0)  # the last sequence's last event, through the merge
    assert s.handle(ev.AnswerRelayed(), 0.0) == []
    assert s.handle(ev.ClientLeft(), 0.0) == []
    assert s.state == _S.CLOSED


def test_a_split_answer_splits_into_some_sequence_of_a_stream_begun() -> None:
    s = ProxySession()
    with pytest.raises(LocalProtocolError, match="SILENT has no row for AnswerSplit"):
        s.handle(ev.AnswerSplit((0,)), 0.0)  # the client has nothing: no stream to go on
    s.handle(ev.HeadersSent(), 0.0)
    with pytest.raises(LocalProtocolError, match="split into no sequence"):
        s.handle(ev.AnswerSplit(()), 0.0)


def test_a_client_leaving_a_split_answer_aborts_its_sequences_once() -> None:
    s = ProxySession()
    s.handle(ev.HeadersSent(), 0.0)
    s.handle(ev.AnswerSplit((0, 1)), 0.0)
    assert s.handle(ev.ClientLeft(), 0.0) == [fx.AbortSequences()]
    assert s.gone
    s.handle(ev.SequenceEnded(1), 0.0)  # each ends once its room's legs are aborted
    s.handle(ev.SequenceEnded(0), 0.0)
    assert s.state == _S.GONE


_Q = PROXY_SEQUENCE.S
# A sequence's views: its status line is the answer's, always sent.
SEQUENCE_VIEWS = {
    _Q.STREAMING: ([], (True, False, False, False)),
    _Q.STREAM_WHOLE: ([ev.ChunkRelayed(), ev.DoneRelayed()], (True, True, False, False)),
    _Q.ANSWERED: ([ev.ErrorAnswered()], (True, False, True, False)),
    _Q.CLOSED: ([ev.DoneRelayed(), ev.AnswerRelayed(), ev.ClientLeft()],
                (True, False, True, False)),
    _Q.GONE: ([ev.ChunkRelayed(), ev.ClientLeft()], (True, False, False, True)),
}


@pytest.mark.parametrize("state", list(SEQUENCE_VIEWS))
def test_views_of_each_sequence_state(state: str) -> None:
    assert set(SEQUENCE_VIEWS) == set(PROXY_SEQUENCE.states)
    s = SequenceSession()
    path, views = SEQUENCE_VIEWS[state]
    for event in path:
        s.handle(event, 0.0)
    assert s.state == state
    assert (s.headers_sent, s.stream_whole, s.answered, s.gone) == views
    assert s.next_deadline() is None


def test_a_sequence_reports_its_relay_and_an_uncounted_disconnect_and_never_sends_headers(
) -> None:
    s = SequenceSession()
    with pytest.raises(LocalProtocolError, match="proxy_sequence cannot handle HeadersSent"):
        s.handle(ev.HeadersSent(), 0.0)  # the answer's status line is out already
    assert s.handle(ev.AnswerRelayed(), 0.0) == [fx.ReportRelayFinished()]
    other = SequenceSession()
    assert other.handle(ev.ClientLeft(), 0.0) == [fx.ReportSequenceLeft()]
    assert other.handle(ev.AnswerRelayed(), 0.0) == []  # a send racing the cancellation

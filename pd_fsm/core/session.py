"""ProxySession: the client's side of one proxy request (table proxy_session).

A request lives in one room at a time (table room, ``RoomRouter``); a retry or a migration opens
the next. What the client has of its answer spans those rooms: nothing yet (an error is a JSON
answer), a stream begun (an error goes in-band, a migration keeps the headers), a stream whole
up to D's ``[DONE]``, the whole answer — or the client has left. The proxy feeds what it sent
(``ev.SessionEvent``) through ``drive`` and carries out what the rows say: report the room's
relay finished, or its client gone, to the router.

Why a table of its own rather than flags derived from the room table's state: a room ends
(RETRIED, MIGRATED, HANDED_OFF) while the client's answer goes on in the next room, and the
room table cannot say what the client already has of it (a status line, D's ``[DONE]``) — two
rooms of one request would have to agree on it. The old ``_Session`` kept that as booleans
(headers_sent, sse_done, relay_finished, client_gone); here they are this table's states, run by
the one driver and checked pair by pair in ``tests/unit/test_core_exhaustive.py``.

An n > 1 stream that breaks goes on as its unfinished sequences, each a request of its own
(``AnswerSplit``): the answer's session waits in SPLIT until each has ended (``SequenceEnded``;
the last one's trigger is LastSequenceEnded), and what the client has of each sequence is a
``SequenceSession`` (table proxy_sequence). Both used to be flags of the proxy (its response's
``apart``, its sequence requests' ``part``).
"""

from __future__ import annotations

from collections.abc import Callable

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import PROXY_SEQUENCE, PROXY_SESSION, StateTable

_T = PROXY_SESSION.T
_S = PROXY_SESSION.S
_TRIGGER: dict[type, str] = {
    ev.HeadersSent: _T.HeadersSent,
    ev.ChunkRelayed: _T.ChunkRelayed,
    ev.DoneRelayed: _T.DoneRelayed,
    ev.AnswerRelayed: _T.AnswerRelayed,
    ev.ErrorAnswered: _T.ErrorAnswered,
    ev.ClientLeft: _T.ClientLeft,
    ev.AnswerSplit: _T.AnswerSplit,
}
# The client has a status line: an error from here goes in-band, as an event of its stream.
_HEADERS_OUT = frozenset({_S.STREAMING, _S.STREAM_WHOLE, _S.ANSWERED, _S.CLOSED, _S.SPLIT,
                          _S.SPLIT_ENDED})
_ST = PROXY_SEQUENCE.T
_SS = PROXY_SEQUENCE.S
# A sequence's events are those of a stream under a status line already sent.
_SEQUENCE_TRIGGER: dict[type, str] = {
    ev.ChunkRelayed: _ST.ChunkRelayed,
    ev.DoneRelayed: _ST.DoneRelayed,
    ev.AnswerRelayed: _ST.AnswerRelayed,
    ev.ErrorAnswered: _ST.ErrorAnswered,
    ev.ClientLeft: _ST.ClientLeft,
}
_Handlers = dict[str, Callable[..., None]]


def _take(table: StateTable, state: str, trigger: str | None, event: ev.SessionEvent,
          handlers: _Handlers) -> tuple[str, list[fx.SessionEffect]]:
    """One row of ``table`` from ``state`` on ``trigger`` (None: ``event`` is not one of the
    table's): its target state and its effects, built in order."""
    if trigger is None:
        raise LocalProtocolError(f"{table.name} cannot handle {type(event).__name__}")
    tr = table.step(state, trigger)
    if tr is None:
        raise LocalProtocolError(f"{table.name}: {state} has no row for {trigger}")
    out: list[fx.SessionEffect] = []
    for name in tr.effects:
        handlers[name](out)
    return tr.target, out


class ProxySession:
    table = PROXY_SESSION

    def __init__(self) -> None:
        self.state = self.table.initial
        self._fx = bind_effects(self, self.table)
        self._running: set[int] = set()  # a split answer's sequences that have not ended

    def handle(self, event: ev.SessionEvent, now: float) -> list[fx.SessionEffect]:
        trigger = self._trigger(event)
        self.state, out = _take(self.table, self.state, trigger, event, self._fx)
        if isinstance(event, ev.AnswerSplit):
            self._running = set(event.sequences)
        elif isinstance(event, ev.SequenceEnded):
            self._running.discard(event.index)
        return out

    def _trigger(self, event: ev.SessionEvent) -> str | None:
        """``event``'s trigger; a sequence's end is the last one's when no other runs."""
        if isinstance(event, ev.AnswerSplit) and not event.sequences:
            raise LocalProtocolError("proxy_session: an answer split into no sequence")
        if not isinstance(event, ev.SequenceEnded):
            return _TRIGGER.get(type(event))
        if event.index not in self._running:
            raise LocalProtocolError(f"proxy_session: sequence {event.index} is not running")
        return _T.SequenceEnded if len(self._running) > 1 else _T.LastSequenceEnded

    def next_deadline(self) -> float | None:
        return None  # no wait of its own: the room's deadline bounds every one

    # -- what the proxy asks --------------------------------------------------------------------

    @property
    def headers_sent(self) -> bool:
        return self.state in _HEADERS_OUT

    @property
    def stream_whole(self) -> bool:
        """D's ``[DONE]`` is relayed: only the body's end is left to send."""
        return self.state == _S.STREAM_WHOLE

    @property
    def answered(self) -> bool:
        """The whole answer is out (or in the last send), and the connection may have ended."""
        return self.state in (_S.ANSWERED, _S.CLOSED)

    @property
    def gone(self) -> bool:
        return self.state == _S.GONE

    # -- effects (names from the table) ---------------------------------------------------------

    def _fx_ReportRelayFinished(self, out: list[fx.SessionEffect]) -> None:
        out.append(fx.ReportRelayFinished())

    def _fx_ReportDisconnect(self, out: list[fx.SessionEffect]) -> None:
        out.append(fx.ReportDisconnect())

    def _fx_AbortSequences(self, out: list[fx.SessionEffect]) -> None:
        out.append(fx.AbortSequences())


class SequenceSession:
    """The client's side of one sequence of a split answer (table proxy_sequence): what the
    proxy reads of it is what it reads of a ``ProxySession``, its status line being the
    answer's."""

    table = PROXY_SEQUENCE

    def __init__(self) -> None:
        self.state = self.table.initial
        self._fx = bind_effects(self, self.table)

    def handle(self, event: ev.SessionEvent, now: float) -> list[fx.SessionEffect]:
        self.state, out = _take(self.table, self.state, _SEQUENCE_TRIGGER.get(type(event)),
                                event, self._fx)
        return out

    def next_deadline(self) -> float | None:
        return None  # as the answer's session: its room's deadline bounds every wait

    @property
    def headers_sent(self) -> bool:
        """Always: the answer's status line went out before the break that split it."""
        return True

    @property
    def stream_whole(self) -> bool:
        return self.state == _SS.STREAM_WHOLE

    @property
    def answered(self) -> bool:
        return self.state in (_SS.ANSWERED, _SS.CLOSED)

    @property
    def gone(self) -> bool:
        return self.state == _SS.GONE

    def _fx_ReportRelayFinished(self, out: list[fx.SessionEffect]) -> None:
        out.append(fx.ReportRelayFinished())

    def _fx_ReportSequenceLeft(self, out: list[fx.SessionEffect]) -> None:
        out.append(fx.ReportSequenceLeft())

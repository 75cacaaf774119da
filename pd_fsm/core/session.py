"""ProxySession: the client's side of one proxy request (table proxy_session, issue 29 §4).

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
"""

from __future__ import annotations

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import PROXY_SESSION

_T = PROXY_SESSION.T
_S = PROXY_SESSION.S
_TRIGGER: dict[type, str] = {
    ev.HeadersSent: _T.HeadersSent,
    ev.ChunkRelayed: _T.ChunkRelayed,
    ev.DoneRelayed: _T.DoneRelayed,
    ev.AnswerRelayed: _T.AnswerRelayed,
    ev.ErrorAnswered: _T.ErrorAnswered,
    ev.ClientLeft: _T.ClientLeft,
}
# The client has a status line: an error from here goes in-band, as an event of its stream.
_HEADERS_OUT = frozenset({_S.STREAMING, _S.STREAM_WHOLE, _S.ANSWERED, _S.CLOSED})


class ProxySession:
    table = PROXY_SESSION

    def __init__(self) -> None:
        self.state = self.table.initial
        self._fx = bind_effects(self, self.table)

    def handle(self, event: ev.SessionEvent, now: float) -> list[fx.SessionEffect]:
        trigger = _TRIGGER.get(type(event))
        if trigger is None:
            raise LocalProtocolError(f"ProxySession cannot handle {type(event).__name__}")
        tr = self.table.step(self.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"proxy_session: {self.state} has no row for {trigger}")
        self.state = tr.target
        out: list[fx.SessionEffect] = []
        for name in tr.effects:
            self._fx[name](out)
        return out

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

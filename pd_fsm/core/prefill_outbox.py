"""What kv_sender's rows say to D (ABORT) and answer our own leg, for ``PrefillEndpoint``:
effects built from the room, keeping nothing.
"""

from __future__ import annotations

from pd_fsm.core import effects as fx
from pd_fsm.core.messages import Abort
from pd_fsm.core.prefill_room import SenderRoom
from pd_fsm.core.rooms import Cause

_Fx = fx.PrefillEffect


class SenderOutbox:
    def _fx_BindPeer(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        pass  # r.peer was set when the RECV_INIT was checked (before any abort could need it)

    def _fx_SendAbort(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        if r.peer is not None:
            out.append(fx.SendMessage(r.peer, Abort(r.room, cause.reason)))

    def _fx_CompleteRequest(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        out.append(fx.CompleteRequest(r.room))

    def _fx_FailRequest(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        out.append(fx.FailRequest(r.room, cause.reason, cause.status))

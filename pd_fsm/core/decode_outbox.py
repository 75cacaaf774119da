"""What kv_receiver's rows say to P (RECV_INIT, DONE, ABORT) and ask of D's own scheduler (the
room's pages, its answer), for ``DecodeEndpoint``: effects built from the room, keeping nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from pd_fsm.core import effects as fx
from pd_fsm.core.decode_peers import Peer
from pd_fsm.core.decode_room import ReceiverRoom
from pd_fsm.core.messages import Abort, Done, RecvInit
from pd_fsm.core.rooms import Cause

_Fx = fx.DecodeEffect


class ReceiverOutbox:
    """``identity``: our reply_to; ``peers``: the peer tracker's (a hello names the heartbeat
    it follows)."""

    def __init__(self, identity: str, layout_hash: str, incarnation: int,
                 peers: Mapping[str, Peer]) -> None:
        self._identity = identity
        self._layout_hash = layout_hash
        self._incarnation = incarnation
        self._peers = peers

    # -- to P ---------------------------------------------------------------------------------

    def _fx_SendRecvInit(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        r.hello_seq = self._peers[r.peer].hb_seq
        msg = RecvInit(r.room, self._identity, r.n_pages, self._layout_hash, self._incarnation,
                       r.skip)
        out.append(fx.SendMessage(r.peer, msg))

    def _fx_SendDone(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        out.append(fx.SendMessage(r.peer, Done(r.room, True)))

    def _fx_SendDoneFailed(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        out.append(fx.SendMessage(r.peer, Done(r.room, False, why.reason[:512])))

    def _fx_SendAbort(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        if r.peer is not None:
            out.append(fx.SendMessage(r.peer, Abort(r.room, why.reason[:512])))

    # -- to our scheduler ---------------------------------------------------------------------

    def _fx_AllocateBlocks(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.AllocateBlocks(r.room, r.n_pages))

    def _fx_CancelAllocation(
        self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause
    ) -> None:
        out.append(fx.CancelAllocation(r.room))

    def _fx_CancelPull(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.CancelPull(r.room))

    def _fx_ReleaseBlocks(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.ReleaseBlocks(r.room))

    def _fx_CompleteTransfer(
        self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause
    ) -> None:
        out.append(fx.CompleteTransfer(r.room, r.first_token, r.first_logprob, r.first_top))

    def _fx_FailRequest(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.FailRequest(r.room, why.reason, why.status))

"""KVPoll, with sglang's numeric values so that poll() results compare with sglang's."""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)

"""Replay protection for signed side-channel frames and signed registry requests.

A signed frame proves who sent it, not when: without more, anyone who can capture a frame on the
network can send it again. A replayed heartbeat would keep extending a room's KV lease on P, and a
replayed ABORT would fail a room someone else is serving. So a signed frame carries, inside its
MAC, the sender's wall-clock time (ms) and a random nonce (:mod:`pd_fsm.core.codec`), and the
receiver admits it only

* if it was sent within ``window_s`` of the receiver's own wall clock, either way (clock skew
  between P and D machines must stay below that: keep NTP running), and
* if its MAC was not seen before inside that window.

A frame older than the window is refused as stale, so only the MACs of the last two windows need
remembering. Memory is bounded by ``max_entries``; at the bound a fresh frame is refused (counted
by the adapter) rather than forgetting a MAC that may still be replayed.

A restart empties the memory of seen MACs, which alone would let frames captured in the last
window before the restart be replayed to the new process. So a guard also has a floor,
``not_before``: the wall-clock time its owner started (the adapter passes it). A frame sent before
it is refused as stale: no frame meant for this process can predate it. Clocks again: a sender
whose clock is ``s`` seconds behind the receiver's has its frames refused for the first ``s``
seconds after the receiver starts, which NTP keeps to milliseconds.

The bootstrap registry uses the same guard for signed writes (:mod:`pd_fsm.core.request_auth`);
``what`` names the thing in the errors ("frame", "request").

Sans-IO like the rest of the core: the caller passes the receiver's wall-clock time.
"""

from __future__ import annotations

import math
from collections import deque

from pd_fsm.core.errors import RemoteProtocolError

DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ENTRIES = 1_000_000  # ~16k frames/s sustained over a 60 s window
_KEY_BYTES = 16  # a MAC prefix: 128 bits still make an accidental collision impossible


class StaleFrame(RemoteProtocolError):
    """A signed frame sent outside the replay window or before the receiver started (replayed
    late, replayed across a restart, or the clocks disagree)."""


class ReplayedFrame(RemoteProtocolError):
    """A signed frame already accepted once."""


class ReplayGuard:
    """Remembers the MACs of recently accepted frames; see the module docstring."""

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        *,
        not_before: float | None = None,
        what: str = "frame",
    ) -> None:
        if window_s <= 0 or max_entries <= 0:
            raise ValueError("window_s and max_entries must be > 0")
        self.window_s = window_s
        self.max_entries = max_entries
        # The owner's start (wall clock), at the wire's resolution: frames carry their time in
        # whole milliseconds (rounded), so one sent in the millisecond the owner started can read
        # as up to 0.5 ms before it. None: no floor.
        self.not_before = None if not_before is None else math.floor(not_before * 1000) / 1000
        self.what = what
        self._seen: set[bytes] = set()
        # (forget_at, key) in acceptance order. forget_at = sent + window and frames arrive a
        # little out of order, so the queue is only roughly sorted: popping from the front while
        # due may keep a key longer than needed (never shorter), within a window or two.
        self._expiry: deque[tuple[float, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, sent_at: float, mac: bytes, now: float) -> None:
        """Accept a frame signed with ``mac`` and sent at ``sent_at``, or raise."""
        self._forget(now)
        what = self.what
        age = now - sent_at
        if age > self.window_s:
            raise StaleFrame(f"{what} sent {age:.1f} s ago, outside the {self.window_s:g} s window")
        if -age > self.window_s:
            raise StaleFrame(
                f"{what} sent {-age:.1f} s in the future, outside the {self.window_s:g} s window "
                "(are the machines' clocks in sync?)"
            )
        if self.not_before is not None and sent_at < self.not_before:
            raise StaleFrame(
                f"{what} sent {self.not_before - sent_at:.3f} s before this process started "
                "(a replay from before a restart, or the sender's clock is behind ours)"
            )
        key = mac[:_KEY_BYTES]
        if key in self._seen:
            raise ReplayedFrame(f"{what} replayed (its signature was already accepted)")
        if len(self._seen) >= self.max_entries:
            raise RemoteProtocolError(
                f"replay guard full ({self.max_entries} {what}s in {self.window_s:g} s)"
            )
        self._seen.add(key)
        # Kept until the frame would be refused as stale anyway.
        self._expiry.append((sent_at + self.window_s, key))

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])

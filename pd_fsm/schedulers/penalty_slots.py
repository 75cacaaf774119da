"""The penalties' counts on the device: which running requests the fused step counts generated
tokens for, a row each of ``counts[slots, V]``.

A request with a frequency, presence or repetition penalty needs, at each step, how often it
generated each token. On the host that history is ``Req.history``; a step dispatched before the
last one's tokens are read (the overlapped loop) cannot wait for it, so the step itself counts:
each penalized row has a slot, the step penalizes its logits by that row of counts and adds the
token it chose (``step/program.packed_step``). A slot is seeded from the host's history when a
request first takes one (its prefill, or its first fused step here: a resumed stream, a row the
chain ran last), and freed once the request finishes. A step whose penalized rows would need
more slots than are free goes to the chain, as every penalized row did before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.step.program import compile_seed_counts, seed_counts
from pd_fsm.schedulers.request import Req, ReqState

# At most this many penalized requests at once on the device (64 rows of Qwen3's vocabulary:
# 39 MB of int32 counts).
PENALTY_SLOTS = 64


def counted(req: Req) -> bool:
    """Whether ``req``'s choice needs its generated tokens counted (``min_new_tokens``' bans
    need no counts: they travel in the step's bitmask)."""
    sp = req.sampling
    return (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or sp.repetition_penalty != 1.0)


class PenaltySlots:
    """The counts (``counts``: ``[slots, vocab]`` int32, on the device) and who holds which
    row."""

    def __init__(self, slots: int, vocab: int) -> None:
        self.vocab = vocab
        self.counts = upload(np.zeros((slots, vocab), np.int32))
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[int, tuple[Req, int]] = {}  # id(req): the request (kept), its slot

    def compile(self) -> None:
        """Compile the seeding program (before ready: a first penalized request compiles
        nothing)."""
        compile_seed_counts(*self.counts.shape)

    def fit(self, rows: Sequence[Req | None]) -> bool:
        """Whether every penalized row among ``rows`` holds a slot or can take one."""
        new = {id(r) for r in rows if r is not None and counted(r) and id(r) not in self._held}
        if len(new) > len(self._free):
            self._sweep()
        return len(new) <= len(self._free)

    def slots_for(self, rows: Sequence[Req | None]) -> list[int]:
        """Each row's slot (-1: no penalty), a new one seeded with what the request generated
        so far. ``fit(rows)`` first."""
        out = []
        for r in rows:
            if r is None or not counted(r):
                out.append(-1)
                continue
            held = self._held.get(id(r))
            if held is None:
                if not self._free:
                    self._sweep()
                held = self._held[id(r)] = (r, self._free.pop())
                self._seed(held[1], r.history)
            out.append(held[1])
        return out

    def forget(self, rows: Sequence[Req | None]) -> None:
        """The chain chose these rows' tokens: their counts here fall behind, so their slots go
        (the next fused step seeds them anew)."""
        for r in rows:
            held = self._held.pop(id(r), None) if r is not None else None
            if held is not None:
                self._free.append(held[1])

    def held(self) -> int:
        return len(self._held)

    def _sweep(self) -> None:
        for key, (req, slot) in list(self._held.items()):
            if req.state is ReqState.FINISHED:
                del self._held[key]
                self._free.append(slot)

    def _seed(self, slot: int, history: Sequence[int]) -> None:
        row = np.bincount(np.asarray(history, np.int64), minlength=self.vocab)[: self.vocab]
        self.counts = EXECUTABLES.call(seed_counts, {}, self.counts,
                                       upload(np.asarray(slot, np.int32)),
                                       upload(row.astype(np.int32)))

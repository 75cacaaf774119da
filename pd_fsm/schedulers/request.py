"""A generation request's record as the scheduler sees it, and what it reports back."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from pd_fsm.jax_engine.sampling import SamplingParams
from pd_fsm.jax_engine.tokenizer import IncrementalDetokenizer


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, no pages yet
    PREFILLING = "prefilling"  # pages held, prompt (partly) not yet in the KV pool
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@attrs.frozen
class FinishReason:
    kind: Literal["stop", "length", "abort"]
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str | None = None  # why an abort happened

    def to_json(self, completion_tokens: int) -> dict[str, Any]:
        """The ``meta_info.finish_reason`` object sglang returns."""
        if self.kind == "length":
            return {"type": "length", "length": completion_tokens}
        if self.kind == "abort":
            return {"type": "abort", "message": self.message}
        return {"type": "stop", "matched": self.matched}


@attrs.frozen
class RequestOutput:
    """What one ``step()`` produced for one request: the increment since its previous output."""

    rid: str
    new_token_ids: tuple[int, ...]
    # Log-prob of each new token under the model's raw distribution (see sampling.py).
    new_logprobs: tuple[float, ...]
    text_delta: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _int_list(ids: Iterable[int]) -> list[int]:
    return [int(i) for i in ids]


@attrs.define(eq=False)
class Req:
    rid: str
    input_ids: list[int] = attrs.field(converter=_int_list)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    # Opaque per-request data for layers above (e.g. bootstrap host/port/room for PD).
    metadata: dict[str, Any] = attrs.field(factory=dict)

    state: ReqState = ReqState.WAITING
    # Pool pages reserved for the whole sequence, in position order; None when none are held.
    pages: list[int] | None = None
    # Prompt tokens whose K/V is in the pages (chunked prefill progress).
    prefilled: int = 0
    output_ids: list[int] = attrs.field(factory=list)
    output_logprobs: list[float] = attrs.field(factory=list)
    finish_reason: FinishReason | None = None
    seed: int = 0  # resolved sampling seed
    # Output text so far (after stop-string trimming) and how much of it was already reported.
    text: str = ""
    text_sent: int = 0
    tokens_sent: int = 0
    detokenizer: IncrementalDetokenizer | None = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

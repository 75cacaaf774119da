"""A generation request's record as the scheduler sees it, and what it reports back."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from pd_fsm.jax_engine.sampling.grammar import Matcher
from pd_fsm.jax_engine.sampling.params import TOP_LOGPROBS_COMPUTED, SamplingParams, TopLogprobs
from pd_fsm.text.tokenizer import IncrementalDetokenizer

# A request's sampling seed is in [0, SEED_LIMIT) (the HTTP schemas refuse others).
SEED_LIMIT = 2**63


def fork_seed(seed: int, index: int) -> int:
    """The seed sequence ``index`` of an n > 1 request samples with, its request's being
    ``seed`` (sequence 0's own). The sampler keys each token by (seed, position), so a request
    of its own with this seed and n = 1 draws what that sequence drew: a proxy continues one
    sequence of a broken stream that way (request migration). Modulo SEED_LIMIT, so
    that it is a request's seed too; the sampler reads the low 32 bits, which that keeps."""
    return (seed + index) % SEED_LIMIT


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


def _top_range(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= TOP_LOGPROBS_COMPUTED:
        raise ValueError(f"top must be in [0, {TOP_LOGPROBS_COMPUTED}], got {value}")


@attrs.frozen
class LogprobSpec:
    """The log-probs a request reports besides its sampled tokens' own (which are always kept).

    ``top``: the most likely alternatives at each reported position (sglang's
    ``top_logprobs_num``, OpenAI's ``top_logprobs`` / completions' ``logprobs``).
    ``prompt_from``: the first prompt position whose token's log-prob is reported (sglang's
    ``logprob_start_len``; OpenAI's ``echo``: 0); -1 for none. Computed by the worker that
    prefills: it runs those prefills with every position's logits.
    """

    top: int = attrs.field(default=0, validator=_top_range)
    prompt_from: int = -1

    @property
    def prompt(self) -> bool:
        return self.prompt_from >= 0


NO_LOGPROBS = LogprobSpec()


@attrs.frozen
class PromptLogprobs:
    """Prompt positions ``start..`` : each token's log-prob given the tokens before it (None for
    position 0, which nothing predicts) and, when asked, each position's top alternatives."""

    start: int
    logprobs: tuple[float | None, ...]
    top: tuple[TopLogprobs | None, ...] = ()


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
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Each new token's position's top alternatives (when the request asked for them).
    new_top_logprobs: tuple[TopLogprobs, ...] = ()
    # In the request's first output only, when it asked for them and this worker prefilled it.
    prompt_logprobs: PromptLogprobs | None = None
    # Which of the request's n sequences this is (sampling n > 1), and whether others of them
    # are still running when this one finished.
    index: int = 0
    more: bool = False
    # In the output carrying the first token, where this worker prefilled the request: when its
    # first forward was run and when that token reached the host (time.monotonic()).
    first_token_times: tuple[float, float] | None = None

    @property
    def finished(self) -> bool:
        """The request is over: this sequence finished and no other is left."""
        return self.finish_reason is not None and not self.more


@attrs.frozen
class Resume:
    """Tokens a request already generated on a worker that failed (request migration, issue
    32): the prompt is prefilled with them appended and generation goes on at the next position,
    so a greedy or seeded request continues exactly as it would have run uninterrupted."""

    output_ids: tuple[int, ...]
    text_sent: int = 0  # characters of their text the client already has


def _int_list(ids: Iterable[int]) -> list[int]:
    return [int(i) for i in ids]


@attrs.define(eq=False)
class Req:
    rid: str
    input_ids: list[int] = attrs.field(converter=_int_list)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    # Opaque per-request data for layers above (e.g. bootstrap host/port/room for PD).
    metadata: dict[str, Any] = attrs.field(factory=dict)
    logprobs: LogprobSpec = attrs.field(factory=LogprobSpec)

    state: ReqState = ReqState.WAITING
    # Pool pages reserved for the whole sequence, in position order; None when none are held.
    pages: list[int] | None = None
    # Prompt tokens whose K/V is in the pages (chunked prefill progress).
    prefilled: int = 0
    cached_tokens: int = 0  # of those, from the prefix cache
    # time.monotonic() when its first forward was run here, and when its first token reached
    # the host (None where another worker prefilled it): the parts of a TTFT.
    prefill_started: float | None = None
    first_token_at: float | None = None
    output_ids: list[int] = attrs.field(factory=list)
    output_logprobs: list[float] = attrs.field(factory=list)
    output_top: list[TopLogprobs] = attrs.field(factory=list)  # only with logprobs.top
    # Prompt log-probs from logprobs.prompt_from on, filled chunk by chunk by the prefill.
    prompt_logprobs: list[float | None] = attrs.field(factory=list)
    prompt_top: list[TopLogprobs | None] = attrs.field(factory=list)
    # Sampling n > 1: the sequence's place, and (on the first) every sequence of the request.
    index: int = 0
    family: list[Req] = attrs.field(factory=list)
    parent: Req | None = None
    prompt_logprobs_ready: bool = False  # the prefill (here) computed all of them
    prompt_logprobs_sent: bool = False
    finish_reason: FinishReason | None = None
    seed: int = 0  # resolved sampling seed
    # Output text so far (after stop-string trimming) and how much of it was already reported.
    text: str = ""
    text_sent: int = 0
    tokens_sent: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    matcher: Matcher | None = None  # structured output: this sequence's place in its grammar
    # A resumed request (``Resume``): its last ``resumed`` input ids are output it generated
    # elsewhere; they count as output (max tokens, usage, sampling positions, stop strings).
    resumed: int = 0

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def position(self) -> int:
        """The output position of the next sampled token: the sampler's key is a function of
        (seed, position), so a resumed request draws what it would have drawn."""
        return self.resumed + len(self.output_ids)

    @property
    def history(self) -> tuple[int, ...]:
        """Every token this request generated, here or (resumed) before."""
        done = self.input_ids[len(self.input_ids) - self.resumed :] if self.resumed else []
        return (*done, *self.output_ids)

    @property
    def root(self) -> Req:
        """The request's first sequence (itself unless it was forked from one)."""
        return self.parent if self.parent is not None else self

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds: a fork's first step feeds the prompt's last
        token again (its position's KV is rewritten in the fork's own copy of that page)."""
        return self.output_ids[-1] if self.output_ids else self.input_ids[-1]

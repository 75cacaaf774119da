"""What a request asks of the sampler: ``SamplingParams`` and the log-prob limits, value types
the HTTP layer builds and checks without importing JAX (``sampler`` runs them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from pd_fsm.jax_engine.sampling.grammar import Constraint

# Alternatives per position (OpenAI's top_logprobs maximum). Always this many are computed, and
# each row keeps its own first k: one compiled shape per batch bucket, whatever k a request asks.
TOP_LOGPROBS_COMPUTED = 20

# A position's most likely tokens: (token id, log-prob) pairs, most likely first.
TopLogprobs = tuple[tuple[int, float], ...]


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _top_p_range(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


MAX_N = 16


def _n_range(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 1 <= value <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {value}")


def _to_tuple(value: Sequence[object] | str | None) -> tuple[object, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    max_new_tokens: int = attrs.field(default=128, validator=_non_negative)
    # 0 means greedy (argmax).
    temperature: float = attrs.field(default=1.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, validator=_top_p_range)
    # <= 0 disables top-k.
    top_k: int = -1
    # None: the scheduler draws one from its own seeded generator (reproducible per scheduler run).
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Penalties on the tokens generated so far (sglang's and OpenAI's semantics, output tokens
    # only): frequency subtracts penalty x count, presence subtracts it once; repetition divides
    # a positive logit by it and multiplies a negative one (1 = off).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = attrs.field(default=1.0, validator=_positive)
    # No EOS or stop token before this many new tokens.
    min_new_tokens: int = attrs.field(default=0, validator=_non_negative)
    # Sequences sampled from the prompt (OpenAI's and sglang's n): the prompt is prefilled once
    # and the sequences share its pages (``Scheduler._fork``).
    n: int = attrs.field(default=1, validator=_n_range)
    # Structured output: every token keeps the text inside this grammar (grammar.py).
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits need adjusting before a token is chosen (``adjust_logits``)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_new_tokens > 0)

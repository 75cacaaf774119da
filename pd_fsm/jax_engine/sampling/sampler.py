"""The batched, jitted token sampler, and the log-probs a request can ask for (the parameters,
a value type without JAX, are in ``params``).

Every row samples from its own key ``fold_in(PRNGKey(seed), step)`` where ``step`` is the index of
the token being generated, so a seeded request draws the same tokens whatever else shares its batch.
The returned log-prob is that of the chosen token under the model's raw distribution (softmax of the
unmodified logits, before temperature / top-k / top-p), which is what ``return_logprob`` reports.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.sampling.grammar import allow_every_token, bitmask_words
from pd_fsm.jax_engine.sampling.params import TOP_LOGPROBS_COMPUTED, SamplingParams, TopLogprobs


def _allowed(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """``logits`` with every token the row's bitmask forbids at -inf (bit ``t % 32`` of word
    ``t // 32``; an unconstrained row's words are all ones)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return jnp.where(allowed == 1, logits, -jnp.inf)


def greedy_tokens(logits: jax.Array, bitmask: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
    """Each row's most likely token (among those its bitmask allows) and its raw log-prob."""
    allowed = logits if bitmask is None else _allowed(logits, bitmask)
    tokens = jnp.argmax(allowed, axis=-1).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


@jax.jit
def _greedy(logits: jax.Array, bitmask: jax.Array) -> tuple[jax.Array, jax.Array]:
    return greedy_tokens(logits, bitmask)


def penalized_logits(logits: jax.Array, counts: jax.Array, repetition: jax.Array,
                     frequency: jax.Array, presence: jax.Array) -> jax.Array:
    """``adjust_logits``' penalties on the device, every row at once: ``counts[S, V]`` how often
    each row generated each token (a row of zeros: that row as it is)."""
    seen = counts > 0
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - jnp.where(
        seen, frequency[:, None] * counts.astype(jnp.float32) + presence[:, None], 0.0)


def penalize_rows(logits: jax.Array, counts: jax.Array, slots: jax.Array,
                  repetition: jax.Array, frequency: jax.Array, presence: jax.Array
                  ) -> jax.Array:
    """The logits each row chooses from: row ``i``'s penalized by its counts, row
    ``slots[i]`` of ``counts[slots, V]`` (-1: no penalty). A step without a penalized row skips
    the gather and the arithmetic over the vocabulary."""
    on = slots >= 0

    def adjusted() -> jax.Array:
        rows = counts[jnp.clip(slots, 0, counts.shape[0] - 1)]
        return penalized_logits(logits, jnp.where(on[:, None], rows, 0), repetition,
                                frequency, presence)

    out: jax.Array = jax.lax.cond(jnp.any(on), adjusted, lambda: logits)
    return out


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    bitmask: jax.Array,
    choose_from: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each row's token and its raw log-prob. ``choose_from``: the logits the token is chosen
    from where they are not ``logits`` (penalized); the log-prob is still ``logits``'."""
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    allowed = _allowed(logits if choose_from is None else choose_from, bitmask)
    argmax_tokens = jnp.argmax(allowed, axis=-1).astype(jnp.int32)

    is_greedy = temperature <= 0.0

    def drawn() -> jax.Array:
        scaled = allowed / jnp.where(is_greedy, 1.0, temperature)[:, None]
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        ranks = jnp.arange(vocab)[None, :]
        keep = ranks < jnp.where(top_k > 0, top_k, vocab)[:, None]
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        # A token survives top-p when the mass strictly before it is below top_p: the first
        # always does.
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
        masked = jnp.where(keep, sorted_logits, -jnp.inf)
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seeds, steps)
        picked = jax.vmap(jax.random.categorical)(keys, masked)
        sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(is_greedy, argmax_tokens, sampled)

    # The sort over the vocabulary only where a row draws: a batch of greedy rows is an argmax,
    # so that one program serves both (one compile of a step, not one per sampler).
    tokens = jax.lax.cond(jnp.any(~is_greedy), drawn, lambda: argmax_tokens)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


@jax.jit
def _sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
            seeds: jax.Array, steps: jax.Array, bitmask: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    return sample_tokens(logits, temperature, top_k, top_p, seeds, steps, bitmask)


@attrs.frozen
class Adjustment:
    """What a row's logits need before its token is chosen: the tokens it generated so far
    (for the penalties) and the ids it may not choose yet (``min_new_tokens``)."""

    output_ids: tuple[int, ...]
    banned: frozenset[int]


def adjust_logits(row: np.ndarray, sp: SamplingParams, adjustment: Adjustment) -> None:
    """Apply ``sp``'s penalties and bans to one row of logits, in place (host side: the
    shapes never change, so nothing compiles; only batches with a penalized row pay the copy)."""
    if adjustment.output_ids:
        ids, counts = np.unique(np.asarray(adjustment.output_ids, np.int64), return_counts=True)
        if sp.repetition_penalty != 1.0:
            seen = row[ids]
            row[ids] = np.where(seen > 0, seen / sp.repetition_penalty,
                                seen * sp.repetition_penalty)
        # In float32, as the device's ``penalized_logits`` computes it.
        row[ids] -= (np.float32(sp.frequency_penalty) * counts.astype(np.float32)
                     + np.float32(sp.presence_penalty))
    if adjustment.banned:
        row[np.fromiter(adjustment.banned, np.int64)] = -np.inf


def _log_softmax_at(logits: np.ndarray, token: int) -> float:
    top = float(np.max(logits))
    return float(logits[token] - top - np.log(np.sum(np.exp(logits - top))))


def sample(
    logits: jax.Array,
    params: Sequence[SamplingParams | None],
    seeds: Sequence[int],
    steps: Sequence[int],
    adjustments: Sequence[Adjustment | None] | None = None,
    bitmask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[B]`` and their log-probs ``[B]`` (host arrays) for the first ``len(params)`` rows
    of ``logits[B_pad, V]``; ``None`` rows (padding, or rows that need no token) are greedy.
    ``bitmask`` (``[B_pad, ceil(V / 32)]`` int32, see grammar.py) says which tokens each row
    may choose; without it, any.

    An all-greedy batch skips the sort; otherwise param arrays are padded to ``B_pad`` so the
    sampler compiles once per batch bucket. Rows with an ``Adjustment`` (penalties, bans) choose
    from adjusted logits; their log-probs are still those of the raw distribution.
    """
    n = len(params)
    b_pad = logits.shape[0]
    adjusted = [i for i, a in enumerate(adjustments or ()) if a is not None and params[i]]
    raw: np.ndarray | None = None
    if adjusted:
        raw = np.asarray(logits)
        host = raw.copy()
        for i in adjusted:
            sp, adjustment = params[i], adjustments[i]  # type: ignore[index]
            assert sp is not None and adjustment is not None
            adjust_logits(host[i], sp, adjustment)
        logits = upload(host)
    if bitmask is None:
        bitmask = allow_every_token(b_pad, logits.shape[-1])
    tokens, logprobs = _choose(logits, params, seeds, steps, n, b_pad, upload(bitmask))
    if raw is not None:
        logprobs = logprobs.copy()
        for i in adjusted:
            logprobs[i] = _log_softmax_at(raw[i], int(tokens[i]))
    return tokens, logprobs


# The per-row arrays ``sample_tokens`` takes before the bitmask, in its order.
SAMPLING_ARRAYS = ("temperature", "top_k", "top_p", "seeds", "steps")
# The per-row arrays of ``penalize_rows`` after the counts.
PENALTY_ARRAYS = ("penalty_slots", "repetition", "frequency", "presence")
# The per-row array of how many top log-probs each row asks for (a fused step's).
TOP_LOGPROBS = "top_logprobs"


def sampling_arrays(params: Sequence[SamplingParams | None], seeds: Sequence[int],
                    steps: Sequence[int], b_pad: int) -> dict[str, np.ndarray]:
    """``sample_tokens``' per-row arrays for these rows, padded to ``b_pad`` (greedy and None
    rows: temperature 0)."""
    temperature = np.zeros(b_pad, np.float32)
    top_k = np.zeros(b_pad, np.int32)
    top_p = np.ones(b_pad, np.float32)
    seed_arr = np.zeros(b_pad, np.uint32)
    step_arr = np.zeros(b_pad, np.int32)
    for i, p in enumerate(params):
        if p is None or p.greedy:
            continue
        temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
        seed_arr[i] = seeds[i] & 0xFFFFFFFF
        step_arr[i] = steps[i]
    return dict(zip(SAMPLING_ARRAYS, (temperature, top_k, top_p, seed_arr, step_arr),
                    strict=True))


def penalty_arrays(params: Sequence[SamplingParams | None], slots: Sequence[int],
                   b_pad: int) -> dict[str, np.ndarray]:
    """``penalize_rows``' per-row arrays, padded to ``b_pad`` (a row whose slot is -1, or past
    ``slots``: no penalty)."""
    slot = np.full(b_pad, -1, np.int32)
    repetition = np.ones(b_pad, np.float32)
    frequency = np.zeros(b_pad, np.float32)
    presence = np.zeros(b_pad, np.float32)
    for i, (p, s) in enumerate(zip(params, slots, strict=False)):
        if p is None or s < 0:
            continue
        slot[i] = s
        repetition[i], frequency[i], presence[i] = (p.repetition_penalty, p.frequency_penalty,
                                                     p.presence_penalty)
    return dict(zip(PENALTY_ARRAYS, (slot, repetition, frequency, presence), strict=True))


def greedy_arrays(b_pad: int) -> dict[str, np.ndarray]:
    """The per-row arrays (``SAMPLING_ARRAYS``, ``PENALTY_ARRAYS`` and ``top_logprobs``) of
    ``b_pad`` greedy rows without penalties or top log-probs."""
    return {**sampling_arrays([], [], [], b_pad), **penalty_arrays([], [], b_pad),
            TOP_LOGPROBS: np.zeros(b_pad, np.int32)}


def _choose(
    logits: jax.Array,
    params: Sequence[SamplingParams | None],
    seeds: Sequence[int],
    steps: Sequence[int],
    n: int,
    b_pad: int,
    bitmask: jax.Array,
) -> tuple[np.ndarray, np.ndarray]:
    if all(p is None or p.greedy for p in params):
        tokens, logprobs = EXECUTABLES.call(_greedy, {}, logits, bitmask)
    else:
        rows = sampling_arrays(params, seeds, steps, b_pad)
        tokens, logprobs = EXECUTABLES.call(
            _sample, {}, logits, *(upload(rows[k]) for k in SAMPLING_ARRAYS), bitmask)
    return np.asarray(tokens)[:n], np.asarray(logprobs)[:n]


@jax.jit
def _top_logprobs(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), TOP_LOGPROBS_COMPUTED)
    return ids.astype(jnp.int32), values


def top_logprobs(logits: jax.Array, ks: Sequence[int]) -> list[TopLogprobs]:
    """For row ``i`` of ``logits[B_pad, V]`` (raw), its ``ks[i]`` most likely tokens and their
    log-probs, most likely first (ties: lower id first); rows with ``k == 0`` get ``()``."""
    if not any(ks):
        return [() for _ in ks]
    ids, values = EXECUTABLES.call(_top_logprobs, {}, logits)
    return tops_of(ids, values, ks)


def tops_of(ids: jax.Array, values: jax.Array, ks: Sequence[int]) -> list[TopLogprobs]:
    """Row ``i``'s first ``ks[i]`` of ``TOP_LOGPROBS_COMPUTED`` alternatives (``ids``,
    ``values``: ``[B_pad, K]``, on the host once read)."""
    if not any(ks):
        return [() for _ in ks]
    host_ids, host_values = np.asarray(ids), np.asarray(values)
    return [
        tuple(zip(host_ids[i, :k].tolist(), host_values[i, :k].tolist(), strict=True))
        for i, k in enumerate(ks)
    ]


def top_logprobs_where_asked(logits: jax.Array, ks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``_top_logprobs`` of ``logits[S, V]`` in a step where some row asks (``ks[i] > 0``);
    zeros, without the pass over the vocabulary, where none does."""
    rows = logits.shape[0]

    def none() -> tuple[jax.Array, jax.Array]:
        return (jnp.zeros((rows, TOP_LOGPROBS_COMPUTED), jnp.int32),
                jnp.zeros((rows, TOP_LOGPROBS_COMPUTED), jnp.float32))

    out: tuple[jax.Array, jax.Array] = jax.lax.cond(
        jnp.any(ks > 0), lambda: _top_logprobs(logits), none)
    return out


@functools.partial(jax.jit, static_argnames=("top",))
def _prompt_logprobs(
    logits: jax.Array, next_ids: jax.Array, top: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``logits[B, T, V]`` of a prefill chunk and the prompt token after each position
    ``next_ids[B, T]``: each next token's log-prob ``[B, T]`` and, with ``top``, each position's
    ``TOP_LOGPROBS_COMPUTED`` most likely tokens ``[B, T, K]`` (ids, log-probs)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, next_ids[..., None], axis=-1)[..., 0]
    if not top:
        empty = jnp.zeros((*next_ids.shape, 0))
        return chosen, empty.astype(jnp.int32), empty
    values, ids = jax.lax.top_k(logprobs, TOP_LOGPROBS_COMPUTED)
    return chosen, ids.astype(jnp.int32), values


def prompt_logprobs(
    logits: jax.Array, next_ids: np.ndarray, top: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays of :func:`_prompt_logprobs` (compiled on first use for each chunk shape:
    only prefills that ask for prompt log-probs run it)."""
    chosen, ids, values = EXECUTABLES.call(
        _prompt_logprobs, {"top": top}, logits, upload(next_ids)
    )
    return np.asarray(chosen), np.asarray(ids), np.asarray(values)


@jax.jit
def _last_logits(logits: jax.Array, num_new: jax.Array) -> jax.Array:
    """Each row's last new token's logits ``[B, V]`` out of ``logits[B, T, V]``."""
    return logits[jnp.arange(logits.shape[0]), jnp.maximum(num_new - 1, 0)]


def last_logits(logits: jax.Array, num_new: np.ndarray) -> jax.Array:
    return EXECUTABLES.call(_last_logits, {}, logits, upload(num_new))


def compile_samplers(
    batch: int, vocab: int, sharding: jax.sharding.Sharding | None = None
) -> None:
    """Compile, without running, both samplers and the top-logprobs pass for
    ``logits[batch, vocab]`` (see ``sample``) placed as ``sharding`` (the forward's logits: on
    a tensor-parallel instance, replicated over its mesh)."""
    logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32, sharding=sharding)
    bitmask = jax.ShapeDtypeStruct((batch, bitmask_words(vocab)), jnp.int32)
    EXECUTABLES.compile(_greedy, {}, logits, bitmask)
    EXECUTABLES.compile(_top_logprobs, {}, logits)
    f32, i32, u32 = (
        jax.ShapeDtypeStruct((batch,), t) for t in (jnp.float32, jnp.int32, jnp.uint32)
    )
    EXECUTABLES.compile(_sample, {}, logits, f32, i32, f32, u32, i32, bitmask)

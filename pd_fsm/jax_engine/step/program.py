"""One step as one jitted program: a ragged batch's forward, the KV write, the head and the
sampling, the pool donated and updated in place; what comes back is the sampled tokens.

A step feeds ``q_lens[s]`` new tokens of each sequence ``s`` (a decode row one, a prefill chunk
many), concatenated in ``tokens``; sequence ``s`` has ``kv_lens[s]`` tokens of context once they
are in (so its new tokens sit at positions ``kv_lens[s] - q_lens[s] ...``) in the pages
``page_table[s]`` lists. Each layer writes its new K/V into the pool (the lanes layout,
``KVPoolConfig.lanes``) and then attends with the ragged paged attention kernel, which reads
them back from there. The head runs on each sequence's last new token only.

This is the accelerator's step (``jax_engine/backend.py`` chooses it): on a TPU every jitted
call and host round trip costs far more than the work of a small step (about 9 ms a step for
the chain of ~34 calls ``model/forward.py`` runs), so everything a step does is one program.
The layers are unrolled in it: the pool is one array per layer, which a scan over stacked
layers could not carry without copying it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.attention.ragged_paged import attend, decode_block_q, plan_items
from pd_fsm.jax_engine.attention.reference import (
    ragged_attention_reference,
    token_sequences,
)
from pd_fsm.jax_engine.backend import Attention
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.kv.pool import NULL_PAGE
from pd_fsm.jax_engine.kv.token_write import write_pages_then_tokens
from pd_fsm.jax_engine.model.config import ModelConfig
from pd_fsm.jax_engine.model.forward import KV, Params, experts, mlp, qkv, rms_norm, rope
from pd_fsm.jax_engine.model.params import layer_views
from pd_fsm.jax_engine.sampling.grammar import bitmask_words
from pd_fsm.jax_engine.sampling.sampler import (
    PENALTY_ARRAYS,
    SAMPLING_ARRAYS,
    TOP_LOGPROBS,
    greedy_tokens,
    penalize_rows,
    sample_tokens,
    top_logprobs_where_asked,
)

# What a step returns: the sampled tokens and their log-probs ("greedy": argmax; "sample":
# temperature, top-k, top-p, seeds, a grammar bitmask, penalties and top log-probs per row), or
# the last tokens' logits ("logits": what the tests and the benches compare).
Sampler = Literal["greedy", "sample", "logits"]
KVWrite = Literal["scatter", "pages"]

PREFILL_BLOCK_Q = 128
# Pages each kernel iteration fetches: 512 tokens a block at page size 16.
BLOCK_TOKENS = 512


@attrs.frozen
class StepOptions:
    """How a step program is built for a model on a backend (static for jit)."""

    config: ModelConfig
    attention: Attention = "pallas"
    block_q: int = 0  # 0: decode_block_q for one-token rows, PREFILL_BLOCK_Q otherwise
    block_pages: int = 0  # 0: BLOCK_TOKENS' worth of pages
    unroll_dma: bool = False  # the kernel's page DMAs unrolled rather than in a loop
    # The per-layer KV write of a step of more tokens than sequences: whole pages, then the
    # other tokens (kv/token_write.py: a prefill 17-21 % quicker on a v5e); or an XLA scatter
    # of one row per token, as every decode step writes.
    kv_write: KVWrite = "pages"


def attention_fn(options: StepOptions, q_lens: jax.Array, tokens: int, page_size: int,
                 dtype: Any) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array],
                                         jax.Array]:
    """The step's attention ``(q, pool, kv_lens, page_table) -> out``, its work items planned
    once for every layer."""
    if options.attention == "reference":
        return functools.partial(_reference, q_lens=q_lens)
    group = options.config.group_size
    block_q = options.block_q or (
        decode_block_q(group, dtype) if tokens == q_lens.shape[0]
        else max(PREFILL_BLOCK_Q, decode_block_q(group, dtype)))
    plan = plan_items(q_lens, tokens, block_q)
    block_pages = options.block_pages or max(1, BLOCK_TOKENS // page_size)

    def run(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, table: jax.Array) -> jax.Array:
        return attend(q, pool, q_lens, kv_lens, table, plan, block_pages=block_pages,
                      interpret=options.attention == "interpret",
                      unroll_dma=options.unroll_dma)

    return run


def _reference(q: jax.Array, pool: jax.Array, kv_lens: jax.Array, table: jax.Array, *,
               q_lens: jax.Array) -> jax.Array:
    return ragged_attention_reference(q, pool, q_lens, kv_lens, table)


# (pool, entry [tokens, lanes]) -> the pool with the step's new K/V in it
Write = Callable[[jax.Array, jax.Array], jax.Array]


def token_slots(q_lens: jax.Array, kv_lens: jax.Array, page_table: jax.Array, tokens: int,
                page_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each new token's position, page and offset in it (padding: 0, the null page, 0), whether
    it is its sequence's first new token, and whether it is real (not padding)."""
    seq, k = token_sequences(q_lens, tokens)
    real = jnp.arange(tokens) < jnp.sum(q_lens)
    positions = jnp.where(real, kv_lens[seq] - q_lens[seq] + k, 0)
    slot = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    write_page = jnp.where(real, page_table[seq, slot], NULL_PAGE)
    return positions, write_page, jnp.where(real, positions % page_size, 0), k == 0, real


def kv_write_fn(options: StepOptions, q_lens: jax.Array, kv_lens: jax.Array,
                page_table: jax.Array, tokens: int, page_size: int) -> tuple[Write, jax.Array]:
    """The step's KV write (planned once for every layer) and each token's position."""
    positions, write_page, write_off, first, real = token_slots(q_lens, kv_lens, page_table,
                                                                tokens, page_size)
    seqs = q_lens.shape[0]
    if options.kv_write == "scatter" or (options.kv_write == "pages" and tokens == seqs):
        # Padding tokens write to the null page, which nothing reads unmasked. (A step of as
        # many tokens as sequences, a decode step, fills few pages if any.)
        return lambda pool, entry: pool.at[write_page, write_off].set(entry), positions
    if options.kv_write != "pages":
        raise ValueError(f"unknown kv_write {options.kv_write!r}")
    return write_pages_then_tokens(write_page, write_off, first, real, page_size,
                                   seqs), positions


def _layer(x: jax.Array, layer: Params, pool: jax.Array, positions: jax.Array, write: Write,
           attend: Callable[[jax.Array, jax.Array], jax.Array],
           config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    tokens = x.shape[0]
    nh, nkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    h = rms_norm(x, layer["attn_norm"], config.rms_eps)
    q, k, v = qkv(h, layer, config)
    q = q.reshape(1, tokens, nh, d)
    k = k.reshape(1, tokens, nkv, d)
    v = v.reshape(tokens, nkv, d)
    if "q_norm" in layer:
        q = rms_norm(q, layer["q_norm"], config.rms_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_eps)
    q = rope(q, positions[None], config)[0]
    k = rope(k, positions[None], config)[0]
    entry = jnp.stack([k, v], axis=2).reshape(tokens, -1).astype(pool.dtype)
    pool = write(pool, entry)
    attn = attend(q, pool)
    x = x + attn.reshape(tokens, nh * d).astype(x.dtype) @ layer["wo"]
    h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
    if "router" in layer:
        return x + experts(h, layer, config), pool
    return x + mlp(h, layer), pool


@functools.partial(jax.jit, static_argnames=("options", "sampler"), donate_argnames=("kv",))
def step(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    sampling: dict[str, jax.Array],
    *,
    options: StepOptions,
    sampler: Sampler,
) -> tuple[tuple[jax.Array, ...], KV]:
    """One step (module docstring). ``sampling``: for "sample", the rows' ``temperature``,
    ``top_k``, ``top_p``, ``seeds``, ``steps`` and ``bitmask``, and where rows may be penalized
    ``penalty_counts`` (``[slots, V]``) with ``PENALTY_ARRAYS``, where they may ask for top
    log-probs ``top_logprobs`` (each row's count); else empty. Returns ``(tokens [S],
    logprobs [S])`` — with ``top_logprobs``, also each row's ``TOP_LOGPROBS_COMPUTED`` most
    likely tokens and their raw log-probs (``[S, K]`` each; zeros where no row asks) — or
    ``(logits [S, V],)``, and the pool."""
    config = options.config
    n_tokens = tokens.shape[0]
    page_size = kv[0].shape[1]
    write, positions = kv_write_fn(options, q_lens, kv_lens, page_table, n_tokens, page_size)
    attention = attention_fn(options, q_lens, n_tokens, page_size, kv[0].dtype)

    def attend_layer(q: jax.Array, pool: jax.Array) -> jax.Array:
        return attention(q, pool, kv_lens, page_table)

    x = params["embed"][tokens]
    new_kv = []
    for layer, pool in zip(layer_views(params["layers"]), kv, strict=True):
        x, pool = _layer(x, layer, pool, positions, write, attend_layer, config)
        new_kv.append(pool)
    last = jnp.clip(jnp.cumsum(q_lens) - 1, 0, n_tokens - 1)
    h = rms_norm(x[last], params["final_norm"], config.rms_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    logits = (h @ head).astype(jnp.float32)
    if sampler == "logits":
        return (logits,), new_kv
    if sampler == "greedy":
        return greedy_tokens(logits, None), new_kv
    choose = None
    if "penalty_counts" in sampling:
        choose = penalize_rows(logits, sampling["penalty_counts"],
                               *(sampling[name] for name in PENALTY_ARRAYS))
    tokens, logprobs = sample_tokens(logits, sampling["temperature"], sampling["top_k"],
                                     sampling["top_p"], sampling["seeds"], sampling["steps"],
                                     sampling["bitmask"], choose)
    if TOP_LOGPROBS not in sampling:
        return (tokens, logprobs), new_kv
    return (tokens, logprobs, *top_logprobs_where_asked(logits, sampling[TOP_LOGPROBS])), new_kv


# The per-row sampling arrays in ``packed_step``'s batch, in this order, each ``seqs`` int32
# words (a float32 or uint32 array's bits as they are).
PACKED_ROWS = (*SAMPLING_ARRAYS, *PENALTY_ARRAYS, TOP_LOGPROBS)
_ROW_DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32,
               "seeds": np.uint32, "steps": np.int32, "penalty_slots": np.int32,
               "repetition": np.float32, "frequency": np.float32, "presence": np.float32,
               TOP_LOGPROBS: np.int32}


def packed_length(tokens: int, seqs: int, width: int) -> int:
    """The length of ``packed_step``'s batch for ``tokens`` new tokens of ``seqs`` sequences."""
    return 2 * tokens + seqs * (2 + len(PACKED_ROWS) + width)


@functools.partial(jax.jit, static_argnames=("options", "sampler", "seqs", "width"),
                   donate_argnames=("kv", "counts"))
def packed_step(
    params: Params,
    kv: KV,
    batch: jax.Array,
    carried: jax.Array,
    bitmask: jax.Array,
    counts: jax.Array,
    *,
    options: StepOptions,
    sampler: Sampler,
    seqs: int,
    width: int,
) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array, KV]:
    """``step`` with every per-step input but the grammar's bitmask in one int32 array — the
    tokens, each token's index into ``carried`` (-1: the token as given), ``q_lens`` and
    ``kv_lens``, the rows' sampling (``PACKED_ROWS``; greedy rows temperature 0), the ``[seqs,
    width]`` page table — one upload a step (each is a host-to-device transfer of its own,
    ~0.2 ms on the TPU machine: a sampled step took seven with its rows' arrays apart).
    ``bitmask``: ``[seqs, words]``, all ones where no row has a grammar (the runner keeps that
    one on the device). ``carried`` holds the tokens the previous step sampled (``[M]``, row
    ``i`` at ``i``), which a step dispatched before they were read takes as its input;
    returned anew with this step's (its rows first, at most ``M``). ``counts``: ``[slots, V]``,
    how often each penalty slot's request generated each token (``penalty_slots``: a row's
    slot, -1 for none); returned with each penalized row's new token counted, on the device,
    so that a step dispatched before the last one's tokens are read penalizes them too."""
    tokens = (batch.shape[0] - packed_length(0, seqs, width)) // 2
    carry = batch[tokens : 2 * tokens]
    fed = jnp.where(carry >= 0, carried[jnp.clip(carry, 0, carried.shape[0] - 1)],
                    batch[:tokens])
    at = 2 * tokens
    q_lens = batch[at : at + seqs]
    kv_lens = batch[at + seqs : at + 2 * seqs]
    at += 2 * seqs
    sampling = {"bitmask": bitmask, "penalty_counts": counts}
    for name in PACKED_ROWS:
        sampling[name] = jax.lax.bitcast_convert_type(batch[at : at + seqs], _ROW_DTYPES[name])
        at += seqs
    table = batch[at:].reshape(seqs, width)
    out, kv = step(params, kv, fed, q_lens, kv_lens, table, sampling, options=options,
                   sampler=sampler)
    if sampler != "logits":
        carried = carried.at[:seqs].set(out[0][: carried.shape[0]])
        slots = sampling["penalty_slots"]
        counts = counts.at[jnp.where(slots >= 0, slots, counts.shape[0]), out[0]].add(
            1, mode="drop")
    return out, carried, counts, kv


def pack(tokens: np.ndarray, carry: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
         table: np.ndarray, rows: dict[str, np.ndarray]) -> np.ndarray:
    """``packed_step``'s one input array (``rows``: ``PACKED_ROWS``' arrays, ``len(q_lens)``
    each)."""
    words = [np.asarray(rows[name]).astype(_ROW_DTYPES[name]).view(np.int32)
             for name in PACKED_ROWS]
    return np.concatenate([tokens, carry, q_lens, kv_lens, *words, table.reshape(-1)]
                          ).astype(np.int32)


def step_statics(options: StepOptions, sampler: Sampler, seqs: int, width: int
                 ) -> dict[str, object]:
    return {"options": options, "sampler": sampler, "seqs": seqs, "width": width}


def bitmask_struct(seqs: int, vocab: int) -> jax.ShapeDtypeStruct:
    """The shape of ``packed_step``'s bitmask."""
    return jax.ShapeDtypeStruct((seqs, bitmask_words(vocab)), jnp.int32)


def counts_struct(slots: int, vocab: int) -> jax.ShapeDtypeStruct:
    """The shape of ``packed_step``'s penalty counts."""
    return jax.ShapeDtypeStruct((slots, vocab), jnp.int32)


@functools.partial(jax.jit, donate_argnames=("counts",))
def seed_counts(counts: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    """``counts`` with row ``slot`` set to ``row`` (a request's generated tokens counted)."""
    return counts.at[slot].set(row)


def compile_seed_counts(slots: int, vocab: int) -> None:
    """Compile ``seed_counts`` into ``EXECUTABLES`` without running it."""
    EXECUTABLES.compile(seed_counts, {}, counts_struct(slots, vocab),
                        jax.ShapeDtypeStruct((), jnp.int32),
                        jax.ShapeDtypeStruct((vocab,), jnp.int32))


def compile_step(params: Params, kv: list[jax.ShapeDtypeStruct], tokens: int, seqs: int,
                 width: int, carried: int, slots: int, options: StepOptions) -> None:
    """Compile into ``EXECUTABLES``, without running, the packed step for ``tokens`` new tokens
    of ``seqs`` sequences over a ``width``-page table (``carried``: ``M``; ``slots``: the
    penalty counts' rows), with the "sample" sampler (a batch of greedy rows takes its argmax
    branch: the runner's one program)."""
    batch = jax.ShapeDtypeStruct((packed_length(tokens, seqs, width),), jnp.int32)
    prev = jax.ShapeDtypeStruct((carried,), jnp.int32)
    vocab = options.config.vocab_size
    EXECUTABLES.compile(packed_step, step_statics(options, "sample", seqs, width),  # type: ignore[arg-type]
                        params, kv, batch, prev, bitmask_struct(seqs, vocab),
                        counts_struct(slots, vocab))

"""The model on this instance's devices and the KV pool it runs over ("plan apart from run"): the
forwards, sampling, the copy-on-write of a fork's page, and warm-up's compiles.

The scheduler decides what runs (which rows, which pages, padded to which shape) and hands this the
arrays; this runs them and answers with logits, sampled tokens and log-probs. It keeps no request
and no queue.

How a step runs is the backend's choice (``jax_engine.backend``), made here and nowhere above: on
an accelerator one jitted program (``step/program.py``) runs the forward over a lanes-layout pool,
samples on the device and returns the tokens; on a CPU the chain of jitted calls
(``model/forward.py``) returns logits and the sampler runs after it. A prefill whose rows ask
for prompt log-probs takes the chain on every backend, and so does a step whose penalized rows
find no free counts slot (``penalty_slots.py``).

The pool arrays live in a ``KVCacheHolder`` (``kv_holder``, pool ``"main_kv"``); every forward
reads and replaces them through ``with_kv`` under the holder's lock, so a pull thread's scatter
(``holder.swap``) is ordered with forward steps (DESIGN §6).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.backend import Backend
from pd_fsm.jax_engine.compilation.buckets import bucket
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.kv.gather_scatter import as_struct
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool import KVPoolConfig, allocate_kv_pool, copy_pages
from pd_fsm.jax_engine.kv.pool_spec import PoolType
from pd_fsm.jax_engine.model import KV, LoadedModel, compile_forward, decode, extend
from pd_fsm.jax_engine.parallel.tensor_parallel import (
    logits_sharding,
    pool_sharding,
    sharded_params,
)
from pd_fsm.jax_engine.sampling.grammar import allow_every_token
from pd_fsm.jax_engine.sampling.params import TopLogprobs
from pd_fsm.jax_engine.sampling.sampler import (
    compile_samplers,
    last_logits,
    tops_of,
)
from pd_fsm.jax_engine.step.program import (
    StepOptions,
    compile_step,
    pack,
    packed_step,
    step_statics,
)
from pd_fsm.schedulers.penalty_slots import PENALTY_SLOTS, PenaltySlots
from pd_fsm.schedulers.plan import DecodeBatch, PrefillBatch
from pd_fsm.schedulers.request import Req
from pd_fsm.schedulers.row_sampling import RowSampling

R = TypeVar("R")

# Threads compiling the forward shapes at warm-up.
WARMUP_THREADS = 8


def step_seqs(capacity: int) -> list[int]:
    """The fused step's sequence counts: 8, and the runner's capacity. A decode step's cost is
    its reads, whatever the padding of its small matmuls; its attention's grid has a step per
    sequence, so a few rows do not pay for the capacity's. A prefill's attention gathers its
    queries into blocks of 128 rows, at least one per sequence: at 64 sequences 8,192 rows a
    layer where one 1,024-token prompt fills 1,024. On a v5e that prompt's prefill took 27.3 ms
    at 64 sequences and 15.6 ms at 8 (bench/RESULTS_tpu.md; the padding is the likely cause,
    not traced)."""
    return sorted({min(8, capacity), capacity})


def prefill_tokens(capacity: int, top: int) -> list[int]:
    """The fused prefill step's token counts (each at both of ``step_seqs``): x4 from 4x the
    capacity, and ``top``, the largest chunk: a prefill's padding is under 4x (none for a
    full chunk), and each size is a compile of the whole model."""
    sizes = {top}
    n = capacity * 4
    while n < top:
        sizes.add(n)
        n *= 4
    return sorted(sizes)


def warmup_threads() -> int:
    """Threads that compile a start's shapes: one per core this process may use (two on the
    CI's machine, up to WARMUP_THREADS on a TPU host's)."""
    return max(1, min(WARMUP_THREADS, len(os.sched_getaffinity(0))))

MAIN_KV = PoolType.MAIN_KV.value

# What a fused step's executable returns: its sampled tokens and log-probs, the tokens a next
# step can carry, the penalty counts, and the pool.
StepOutput = tuple[tuple[jax.Array, ...], jax.Array, jax.Array, KV]

# A forward shape as recorded: ("extend" | "extend-all", rows, tokens) or ("decode", rows), or
# a fused step's ("step", tokens, sequences).
ForwardShape = tuple[int | str, ...]


@attrs.frozen(eq=False)
class Launched:
    """A decode step dispatched and not yet read: its rows, and what it sampled for them (on
    the device until ``ModelRunner.collect``)."""

    reqs: tuple[Req, ...]
    # The step's tokens, their log-probs and each row's top alternatives (ids, log-probs).
    out: tuple[jax.Array, ...]


@attrs.frozen(eq=False)
class StepResult:
    """What a step gives back for its rows: each row's sampled token and its raw log-prob,
    top alternatives where asked; where the chain ran, the logits they were sampled from
    (None after a fused step, which returns tokens only), and for a prefill with prompt
    log-probs every position's."""

    tokens: np.ndarray
    logprobs: np.ndarray
    tops: list[TopLogprobs]
    logits: jax.Array | None = None
    every_position: jax.Array | None = None


def read_step(out: tuple[jax.Array, ...], rows: Sequence[Req | None]) -> StepResult:
    """A fused step's tokens and log-probs for ``rows`` read back (waiting for the step), and
    the top alternatives a row asked for (read only then)."""
    n = len(rows)
    tokens, logprobs, top_ids, top_values = out
    return StepResult(np.asarray(tokens)[:n], np.asarray(logprobs)[:n],
                      tops_of(top_ids, top_values, RowSampling.tops_asked(rows)))


class ModelRunner:
    """Runs forwards over the pool and samples their logits; records each padded shape it ran."""

    def __init__(
        self,
        model: LoadedModel,
        pool_config: KVPoolConfig,
        table_width: int,
        tp_size: int,
        backend: Backend,
        max_rows: int = 1,
    ) -> None:
        self.backend = backend
        self.config = model.config
        # The weights on this instance's devices (the loaded model itself is shared and stays
        # where it was loaded: sharded copies are made once per tp size).
        self.params = sharded_params(model, tp_size)
        self.eos_token_ids = model.eos_token_ids
        self.rows = RowSampling(self.config.vocab_size, model.eos_token_ids)
        self.tp_size = tp_size
        # Every forward's page table has this width, so the compiled shapes are the batch
        # buckets alone.
        self.table_width = table_width
        self.pool_config = pool_config
        self.kv_holder = KVCacheHolder(
            {MAIN_KV: allocate_kv_pool(pool_config, pool_sharding(tp_size))}
        )
        self.forward_shapes: set[ForwardShape] = set()  # each compiles once
        self.step_options = StepOptions(self.config, attention=backend.attention)
        # The fused step's executables by (tokens, sequences, sampler): a step calls its own
        # without the table's lookup, whose key walks every argument.
        self._steps: dict[tuple[int, int, str], Callable[..., StepOutput]] = {}
        # The tokens the last fused decode step sampled, on the device (a row's at its row):
        # what a step dispatched before they are read takes as its input.
        self._carried = jnp.zeros(bucket(max_rows), jnp.int32)
        if backend.fused_step:  # penalized rows' counts on the device, the step's to keep
            self.rows.slots = PenaltySlots(min(len(self._carried), PENALTY_SLOTS),
                                           self.config.vocab_size)
        self._allowed: dict[int, jax.Array] = {}  # every_token_allowed's, by sequences
        self._prefill_sizes: list[int] = []  # the fused prefill's, once step_shapes chose them

    # ----------------------------------------------------------------- the pool

    def with_kv(self, fn: Callable[[KV], tuple[R, KV]]) -> R:
        """Run ``fn(main_kv) -> (result, new_main_kv)`` under the holder's lock; ``fn`` may donate
        the arrays it is given. Forwards and page copies go through here; the PD roles' gathers
        and a pull thread's scatter take the same lock (``kv_holder``)."""
        with self.kv_holder.locked() as pools:
            result, pools[MAIN_KV] = fn(pools[MAIN_KV])
        return result

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the KV of pages ``src[i]`` into pages ``dst[i]`` (a fork's own copy of the page
        holding the prompt's last token)."""

        def run(kv: KV) -> tuple[None, KV]:
            return None, EXECUTABLES.call(copy_pages, {}, kv, upload(src), upload(dst))

        self.with_kv(run)

    # ----------------------------------------------------------------- steps

    def prefill_step(self, batch: PrefillBatch, completed: Sequence[Req | None]) -> StepResult:
        """Run a planned prefill and sample each completed row's first token (``completed[i]``:
        row ``i``'s request if this chunk ends its prompt, else None). With prompt log-probs
        asked, ``logits`` holds every position's."""
        if (self.backend.fused_step and self.rows.on_device_alone(completed)
                and not any(row.req.logprobs.prompt for row in batch.rows)):
            tokens = np.zeros(batch.n_pad * batch.t_pad, np.int32)
            q_lens = np.zeros(batch.n_pad, np.int32)
            kv_lens = np.zeros(batch.n_pad, np.int32)
            table = np.zeros((batch.n_pad, self.table_width), np.int32)
            at = 0
            for i, row in enumerate(batch.rows):
                req = row.req
                assert req.pages is not None
                tokens[at : at + row.length] = req.input_ids[row.start : row.start + row.length]
                at += row.length
                q_lens[i], kv_lens[i] = row.length, row.start + row.length
                used = self.pool_config.pages_for(row.start + row.length)
                table[i, :used] = req.pages[:used]
            out = self._dispatch(
                tokens, np.full(len(tokens), -1, np.int32), q_lens, kv_lens, table, completed,
                ahead=np.zeros(batch.n_pad, bool), decode=False)
            return read_step(out, completed)  # at once
        logits = self.run_prefill(batch)
        if not any(row.req.logprobs.prompt for row in batch.rows):
            return self._sampled(logits, completed)
        return self._sampled(last_logits(logits, batch.num_new()), completed, logits)

    def decode_step(self, batch: DecodeBatch) -> StepResult:
        """Run a planned decode step: each running sequence's next token."""
        rows: list[Req | None] = list(batch.reqs)
        if self.backend.fused_step and self.rows.on_device_alone(rows):
            return self.collect(self.decode_launch(batch, None))
        return self._sampled(self.run_decode(batch), rows)

    def can_overlap(self, reqs: Sequence[Req]) -> bool:
        """Whether a decode step of these rows may be dispatched before the previous step's
        tokens are read (``decode_launch``): on a backend that overlaps steps, where no row's
        choice depends on the host's state after its last token (a grammar's next mask, the
        logits the chain needs)."""
        return (self.backend.fused_step and self.backend.overlap_steps
                and self.rows.on_device_alone(list(reqs))
                and not any(r.matcher is not None for r in reqs))

    def decode_launch(self, batch: DecodeBatch, previous: Launched | None) -> Launched:
        """Dispatch a fused decode step and return without reading it. A row that was in
        ``previous`` (dispatched, not yet read) is fed the token that step sampled for it,
        still on the device, one position on from what the host knows of it."""
        rows: list[Req | None] = list(batch.reqs)
        tokens, kv_lens, table = self._decode_rows(batch)
        carry = np.full(batch.b_pad, -1, np.int32)
        if previous is not None:
            was = {id(req): j for j, req in enumerate(previous.reqs)}
            for i, req in enumerate(batch.reqs):
                j = was.get(id(req))
                if j is not None:
                    carry[i] = j
                    kv_lens[i] += 1
                    used = min(self.pool_config.pages_for(req.seq_len + 1), len(req.pages or ()))
                    table[i, :used] = (req.pages or [])[:used]
        q_lens = (kv_lens > 0).astype(np.int32)  # one new token a sequence
        return Launched(batch.reqs, self._dispatch(tokens, carry, q_lens, kv_lens, table, rows,
                                                   ahead=carry >= 0, decode=True))

    def collect(self, launched: Launched) -> StepResult:
        """Read a dispatched step's tokens (waiting for it), and its top alternatives where a
        row asked."""
        return read_step(launched.out, launched.reqs)

    def _dispatch(self, tokens: np.ndarray, carry: np.ndarray, q_lens: np.ndarray,
                  kv_lens: np.ndarray, table: np.ndarray, rows: Sequence[Req | None], *,
                  ahead: np.ndarray, decode: bool) -> tuple[jax.Array, ...]:
        """Dispatch a step on its arrays (one array, and a grammar's or a ban's bitmask); what
        it returns (``Launched.out``), on the device. ``ahead``: rows one token past what the host
        knows (their sampling key's step too). A decode step's tokens become what the next one
        can carry; a prefill's are read at once and carried nowhere."""
        tokens, carry, q_lens, kv_lens, table, ahead = self._step_shape(
            tokens, carry, q_lens, kv_lens, table, ahead, decode)
        sampling, bitmask = self.rows.on_device(rows, len(q_lens), ahead)
        self.forward_shapes.add(("step", len(tokens), len(q_lens)))
        # Host arrays go to the executable as they are: its call transfers them (in C++: 3-7 times
        # quicker than a ``device_put`` first on a CPU). Without a grammar or a ban, the
        # bitmask that allows every token, kept on the device.
        batch = pack(tokens, carry, q_lens, kv_lens, table, sampling)
        allowed = self.every_token_allowed(len(q_lens)) if bitmask is None else bitmask
        out, carried = self.run_step(len(tokens), len(q_lens), batch, allowed)
        if decode:
            self._carried = carried
        return out

    def run_step(self, tokens: int, seqs: int, batch: jax.Array | np.ndarray,
                 bitmask: jax.Array | np.ndarray) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """Dispatch the packed step of ``tokens`` new tokens of ``seqs`` sequences on ``batch``
        (the "sample" program: a batch of greedy rows takes its argmax branch); what it
        returns (its tokens, their log-probs, the top alternatives) and the tokens a next step
        may carry, on the device."""
        key = (tokens, seqs, "sample")
        carried = self._carried
        slots = self.rows.slots
        assert slots is not None, "a fused step's runner keeps penalty counts"

        def run(kv: KV) -> tuple[tuple[tuple[jax.Array, ...], jax.Array], KV]:
            exe = self._steps.get(key)
            if exe is None:
                exe = self._steps[key] = EXECUTABLES.executable(
                    packed_step, step_statics(self.step_options, "sample", seqs,
                                              self.table_width),
                    self.params, kv, batch, carried, bitmask, slots.counts)
            out, carry_out, slots.counts, kv = exe(self.params, kv, batch, carried, bitmask,
                                                   slots.counts)
            return (out, carry_out), kv

        return self.with_kv(run)

    def every_token_allowed(self, seqs: int) -> jax.Array:
        """The step's grammar bitmask where no row has a grammar, kept on the device."""
        allowed = self._allowed.get(seqs)
        if allowed is None:
            allowed = self._allowed[seqs] = upload(
                allow_every_token(seqs, self.config.vocab_size))
        return allowed

    def _step_shape(self, tokens: np.ndarray, carry: np.ndarray, q_lens: np.ndarray,
                    kv_lens: np.ndarray, table: np.ndarray, ahead: np.ndarray, decode: bool
                    ) -> tuple[np.ndarray, ...]:
        """A fused step's arrays at its compiled shape (``step_shapes``): the new tokens (at
        the front, where the planner's batch has them) and the sequences padded. A step's work
        is ragged, so the planner's (rows, tokens) padding need not be its shape: six shapes
        serve every batch of a 64-row runner with a 1,024-token budget, where the planner's
        are 42 (a compile takes 20-40 s for a 28-layer model on a TPU). A decode step's tokens
        are its sequences (the attention's decode blocks); a prefill's are more, its sequences
        the fewest of ``step_seqs`` that hold its rows."""
        real = int(q_lens.sum())
        capacity = max(len(self._carried), len(q_lens))
        if decode:
            seqs = next(n for n in step_seqs(capacity) if n >= real)
            n_tokens = seqs
        else:
            used = np.flatnonzero(q_lens)
            rows = int(used[-1]) + 1 if len(used) else 1
            seqs = next(n for n in step_seqs(capacity) if n >= rows)
            # The warm-up's sizes (without one, as if this step were the largest).
            sizes = self._prefill_sizes or prefill_tokens(capacity, bucket(real))
            n_tokens = next((n for n in sizes if n >= real), bucket(real))

        def fit(a: np.ndarray, n: int, fill: int | bool = 0) -> np.ndarray:
            out = np.full((n, *a.shape[1:]), fill, a.dtype)
            out[: min(n, len(a))] = a[:n]
            return out

        return (fit(tokens[:real], n_tokens), fit(carry[:real], n_tokens, -1),
                fit(q_lens, seqs), fit(kv_lens, seqs), fit(table, seqs), fit(ahead, seqs, False))

    def step_shapes(self, plan: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The fused step's ``(tokens, sequences)`` shapes that serve the planner's ``plan``:
        the decode steps' where it has decode shapes, the prefills' where it has prefills."""
        capacity = max([len(self._carried), *(rows for rows, _ in plan)])
        top = bucket(max((rows * tokens for rows, tokens in plan if tokens > 1), default=1))
        self._prefill_sizes = prefill_tokens(capacity, top)
        seqs = step_seqs(capacity)
        shapes = [(n, n) for n in seqs] if any(t == 1 for _, t in plan) else []
        if any(t > 1 for _, t in plan):
            shapes += [(n, s) for n in self._prefill_sizes for s in seqs]
        return sorted(set(shapes))

    def _sampled(self, logits: jax.Array, rows: Sequence[Req | None],
                 every_position: jax.Array | None = None) -> StepResult:
        tokens, logprobs = self.rows.sample(logits, rows)
        return StepResult(tokens, logprobs, self.rows.top_logprobs(logits, rows), logits,
                          every_position)

    # ----------------------------------------------------------------- plans

    def run_prefill(self, batch: PrefillBatch) -> jax.Array:
        """Run a planned prefill forward: each row's chunk into its request's pages. Logits of
        each row's last position, or of every position when a row asks for prompt log-probs
        (only those batches pay for the wider head, and its compile on first use)."""
        tokens = np.zeros((batch.n_pad, batch.t_pad), np.int32)
        start = np.zeros(batch.n_pad, np.int32)
        num_new = batch.num_new()
        table = np.zeros((batch.n_pad, self.table_width), np.int32)
        for i, row in enumerate(batch.rows):
            req = row.req
            assert req.pages is not None
            tokens[i, : row.length] = req.input_ids[row.start : row.start + row.length]
            start[i] = row.start
            used = self.pool_config.pages_for(row.start + row.length)
            table[i, :used] = req.pages[:used]
        every_position = any(row.req.logprobs.prompt for row in batch.rows)
        return self.forward_extend(tokens, start, num_new, table, all_logits=every_position)

    def run_decode(self, batch: DecodeBatch) -> jax.Array:
        """Run a planned decode forward: each sequence's last sampled token; its logits."""
        tokens, lengths, table = self._decode_rows(batch)
        positions = np.maximum(lengths - 1, 0)  # the last sampled token is fed now
        return self.forward_decode(tokens, positions, table, lengths)

    def _decode_rows(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's last sampled token, its sequence's length with it, and its pages (padding
        rows: zeros)."""
        tokens = np.zeros(batch.b_pad, np.int32)
        lengths = np.zeros(batch.b_pad, np.int32)
        table = np.zeros((batch.b_pad, self.table_width), np.int32)
        for i, req in enumerate(batch.reqs):
            assert req.pages is not None
            tokens[i] = req.last_token
            lengths[i] = req.seq_len
            used = self.pool_config.pages_for(req.seq_len)
            table[i, :used] = req.pages[:used]
        return tokens, lengths, table

    # ----------------------------------------------------------------- forwards

    def forward_extend(
        self,
        tokens: np.ndarray,
        start: np.ndarray,
        num_new: np.ndarray,
        table: np.ndarray,
        *,
        all_logits: bool = False,
    ) -> jax.Array:
        """A prefill forward of ``tokens`` ``[rows, t]`` (row ``i``: ``num_new[i]`` tokens from
        position ``start[i]``, into the pages of ``table[i]``); the last position's logits of
        each row, or every position's with ``all_logits``."""
        self.forward_shapes.add(("extend-all" if all_logits else "extend", *tokens.shape))
        params, config = self.params, self.config

        def run(kv: KV) -> tuple[jax.Array, KV]:
            return extend(params, kv, upload(tokens), upload(start),
                          upload(num_new), upload(table), config=config,
                          all_logits=all_logits)

        return self.with_kv(run)

    def forward_decode(
        self, tokens: np.ndarray, positions: np.ndarray, table: np.ndarray, lengths: np.ndarray
    ) -> jax.Array:
        """A decode forward: one token per row at ``positions``; each row's logits."""
        self.forward_shapes.add(("decode", len(tokens)))
        params, config = self.params, self.config

        def run(kv: KV) -> tuple[jax.Array, KV]:
            return decode(params, kv, upload(tokens), upload(positions),
                          upload(table), upload(lengths), config=config)

        return self.with_kv(run)

    # ----------------------------------------------------------------- warm-up

    def compile(self, plan: Sequence[tuple[int, int]]) -> None:
        """Compile, without running anything, the forward of every shape ``(rows, tokens)`` of
        ``plan`` and the samplers of every row count in it."""
        with self.kv_holder.locked() as pools:
            kv = [as_struct(a) for a in pools[MAIN_KV]]  # shapes only: nothing runs here
        params, config, width = self.params, self.config, self.table_width

        def shape(rows_tokens: tuple[int, int]) -> None:
            rows, tokens = rows_tokens
            compile_forward(params, kv, rows, tokens, width, config=config)

        slots = self.rows.slots
        if slots is not None:
            slots.compile()
        n_slots = 0 if slots is None else len(slots.counts)

        def step(tokens_seqs: tuple[int, int]) -> None:
            tokens, seqs = tokens_seqs
            compile_step(params, kv, tokens, seqs, width, len(self._carried), n_slots,
                         self.step_options)

        # XLA compiles without the GIL: a thread per core, up to WARMUP_THREADS.
        with ThreadPoolExecutor(warmup_threads(), thread_name_prefix="warm-up") as pool:
            if self.backend.fused_step:
                list(pool.map(step, self.step_shapes(plan)))
            else:
                list(pool.map(shape, plan))
        if self.backend.fused_step:
            return
        for rows in sorted({r for r, _ in plan}):
            compile_samplers(rows, self.config.vocab_size, logits_sharding(self.tp_size))

"""The colocated scheduler: continuous batching of prefill and decode over the paged KV pool.

Synchronous and single-threaded: a caller (the HTTP worker's thread, a test, a benchmark) calls
``step()``, which runs at most one prefill forward and one decode forward and returns the outputs
they produced. One thread drives it; only ``submit`` and ``request_abort`` may be called from other
threads (they queue work that the next ``step()`` applies).

Life of a request: ``add_request`` -> WAITING -> (pages for the whole sequence reserved, FIFO)
PREFILLING -> (prompt in the pool, possibly over several chunked steps; first token sampled)
RUNNING -> FINISHED. Pages are reserved up front for ``prompt + max_new_tokens`` tokens so a
running request never needs pages mid-decode (no preemption); they are released exactly once, in
``_finish``. The pages themselves, the prefix cache and what a request needs of them are the
``PageBudget``'s (``self.page_budget``, page_budget.py): the scheduler asks it, it holds no queue.
What a sampled token becomes (text, stop strings, the length limit) and the outputs not drained
yet are the ``OutputProcessor``'s (``self.outputs``, output_processor.py): it says why a request
ends, and ``_finish`` ends it.

Extension points for the PD mixins (RFC-2 §5.4) are the underscore methods below; the P mixin
overrides ``_on_prefill_done`` (hand the KV to the transfer instead of decoding) and tells the
page budget that a room's forks are D's (``page_budget.forks_here``); the D mixin registers a
request (``_register``, so ``abort`` finds it), reserves its pages with ``reserve_pages``,
scatters the transferred KV into the prompt's pages, and enters it into the decode batch with
``add_prefilled_request``, skipping the prefill forward. Mixins that keep requests in queues of
their own extend ``_detach`` (and ``has_work``).

The weights on this instance's devices, the pool arrays (``self.kv_holder``), the forwards,
sampling and warm-up's compiles are the ``ModelRunner``'s (``self.runner``, model_runner.py):
the scheduler builds each batch's padded arrays (``_run_prefill``, ``_run_decode``) and the
runner runs them, under the holder's lock (DESIGN §6).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence

import attrs
import jax
import numpy as np

from pd_fsm.jax_engine.compilation.buckets import bucket
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.model import LoadedModel, load_model, table_width
from pd_fsm.jax_engine.parallel.tensor_parallel import check_tp
from pd_fsm.jax_engine.sampling.grammar import compiler_for
from pd_fsm.jax_engine.sampling.params import SamplingParams, TopLogprobs
from pd_fsm.jax_engine.sampling.sampler import last_logits, prompt_logprobs
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.model_runner import ModelRunner
from pd_fsm.schedulers.output_processor import OutputProcessor
from pd_fsm.schedulers.page_budget import PageBudget
from pd_fsm.schedulers.request import (
    FinishReason,
    LogprobSpec,
    Req,
    ReqState,
    RequestOutput,
    Resume,
)

# Smallest padded prompt length: tiny prompts share one compiled shape.
MIN_PREFILL_BUCKET = 8


@attrs.frozen
class PrefillRow:
    req: Req
    start: int  # first prompt position fed in this forward
    length: int  # prompt tokens fed in this forward


@attrs.frozen
class PrefillBatch:
    rows: tuple[PrefillRow, ...]
    n_pad: int
    t_pad: int


@attrs.frozen
class DecodeBatch:
    reqs: tuple[Req, ...]
    b_pad: int


@attrs.frozen
class WarmupReport:
    """What a warm-up compiled: forward shapes ``(rows, tokens)`` and executables, and how long."""

    shapes: tuple[tuple[int, int], ...]
    executables: int
    seconds: float


@attrs.frozen
class SchedulerStats:
    free_pages: int
    cached_pages: int  # held by the prefix cache alone: freed when pages are wanted
    total_pages: int  # usable pages (the null page excluded)
    waiting: int
    prefilling: int
    running: int
    forward_shapes: int  # distinct padded forward shapes used so far (each compiles once)
    cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache, ever
    cache_evicted_pages: int = 0


class Scheduler:
    def __init__(self, args: SchedulerArgs, *, model: LoadedModel | None = None) -> None:
        self.args = args
        self.model = model if model is not None else load_model(
            args.model, args.dtype, args.model_seed
        )
        self.config = self.model.config
        check_tp(self.config, args.tp_size, len(jax.devices()))
        self.tokenizer = self.model.tokenizer
        self.eos_token_ids = self.model.eos_token_ids
        self.pool_config = self.config.kv_pool_config(args.num_pages, args.page_size,
                                                      args.kv_dtype)
        limit = args.context_length or self.config.max_position
        self.context_length = min(limit, self.config.max_position)
        # The pages: allocator, prefix cache, what each request needs (a P worker says whose
        # forks are not its own: page_budget.forks_here).
        self.page_budget = PageBudget(self.pool_config, args.num_pages, self.context_length,
                                      radix_cache=args.radix_cache)
        # Every forward's page table has this width (the longest sequence admitted, in whole
        # context chunks), so the compiled shapes are the batch buckets alone.
        longest = min(self.pool_config.pages_for(self.context_length), args.num_pages - 1)
        self.table_width = table_width(longest, args.page_size)
        # The weights on this instance's devices, the pool, the forwards and sampling.
        self.runner = ModelRunner(self.model, self.pool_config, self.table_width, args.tp_size)
        self.kv_holder = self.runner.kv_holder  # the PD roles gather and scatter rooms' KV in it

        self.reqs: dict[str, Req] = {}  # every live (unfinished) request
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.forward_shapes = self.runner.forward_shapes  # every padded shape run so far
        # The sampled tokens' text, stop conditions and the outputs not drained yet.
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.context_length)
        self._seed_rng = random.Random(args.random_seed)
        # Requests and aborts handed over from other threads; deque append/popleft are atomic.
        self._inbox: deque[Req | tuple[str, str]] = deque()

    # ----------------------------------------------------------------- public API

    def make_request(
        self,
        rid: str,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        logprobs: LogprobSpec | None = None,
        resume: Resume | None = None,
        **metadata: object,
    ) -> Req:
        """A request record; a string prompt is tokenized as is (no chat template). ``resume``:
        tokens it generated before elsewhere, prefilled after the prompt and counted as output
        (its token limits are what is left of them)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sp = sampling or SamplingParams()
        if resume is None or not resume.output_ids:
            return Req(rid, ids, sp, dict(metadata), logprobs or LogprobSpec())
        done = len(resume.output_ids)
        if done >= sp.max_new_tokens:
            raise ValueError(f"resume has {done} tokens: no fewer than max_new_tokens "
                             f"({sp.max_new_tokens})")
        sp = attrs.evolve(sp, max_new_tokens=sp.max_new_tokens - done,
                          min_new_tokens=max(0, sp.min_new_tokens - done))
        return Req(rid, [*ids, *resume.output_ids], sp, dict(metadata),
                   logprobs or LogprobSpec(), resumed=done, text_sent=resume.text_sent)

    def add_request(self, req: Req) -> None:
        """Queue a request; raises ``ValueError`` for one that can never be served."""
        self._register(req)
        self.waiting.append(req)

    def add_prefilled_request(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        """Enter ``req`` straight into the decode batch: its prompt's K/V is already in
        ``req.pages`` (e.g. transferred from a prefill worker) and its first token is sampled."""
        if req.rid not in self.reqs:
            self._register(req)
        if req.pages is None or len(req.pages) < self.page_budget.pages_needed(req):
            raise ValueError(f"request {req.rid} entered decode without its pages reserved")
        self._detach(req)
        req.prefilled = len(req.input_ids)
        self._enter_running(req, first_token, first_logprob, first_top)

    def submit(self, req: Req) -> None:
        """Thread-safe ``add_request``: queued for the next ``step()``. A request that can never
        be served is then finished with an abort output carrying the reason."""
        self._inbox.append(req)

    def request_abort(self, rid: str, message: str = "aborted") -> None:
        """Thread-safe ``abort``: applied at the start of the next ``step()``."""
        self._inbox.append((rid, message))

    def reserve_pages(self, req: Req) -> bool:
        """Reserve ``req``'s pages now (a decode worker does so before the KV transfer)."""
        return self.page_budget.reserve(req)

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Finish a live request (every sequence of it) with an abort reason and free its
        pages; False if unknown."""
        req = self.reqs.get(rid)
        if req is None:
            return False
        for seq in req.family or [req]:
            self._finish(seq, FinishReason("abort", message=message))
        return True

    def step(self) -> list[RequestOutput]:
        """One scheduling iteration; returns the outputs produced since the previous call."""
        self._process_inbox()
        self._admit_waiting()
        prefill = self._build_prefill_batch()
        if prefill is not None:
            self._run_prefill(prefill)
        batch = self._build_decode_batch()
        if batch is not None:
            self._run_decode(batch)
        return self.drain_outputs()

    def drain_outputs(self) -> list[RequestOutput]:
        return self.outputs.drain(self.reqs)

    def has_work(self) -> bool:
        return bool(self._inbox or self.waiting or self.prefilling or self.running
                    or self.outputs.pending)

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Step until nothing is left to do; all outputs in order (tests, benchmarks)."""
        outputs: list[RequestOutput] = []
        for _ in range(max_steps):
            if not self.has_work():
                return outputs
            outputs.extend(self.step())
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    def stats(self) -> SchedulerStats:
        pages = self.page_budget
        return SchedulerStats(
            free_pages=pages.allocator.num_free,
            cached_pages=pages.cached_pages,
            total_pages=pages.allocator.total,
            waiting=len(self.waiting),
            prefilling=len(self.prefilling),
            running=len(self.running),
            forward_shapes=len(self.forward_shapes),
            cache_hit_tokens=pages.cache_hit_tokens,
            cache_evicted_pages=pages.evicted_pages,
        )

    # ----------------------------------------------------------------- compiled shapes

    def shape_plan(self) -> list[tuple[int, int]]:
        """Every padded forward shape ``(rows, tokens)`` this scheduler can run, from its knobs:
        decode ``(b, 1)`` for each batch bucket up to ``max_running``; prefill ``(1, t)`` for each
        length bucket a first row can take, and ``(n, t)`` with ``n * t`` within
        ``max_batched_tokens`` for batches of several rows (``_build_prefill_batch``'s rule).
        The page table's width is fixed (``table_width``), so nothing else varies."""
        a = self.args
        rows = [bucket(n) for n in range(1, a.max_running + 1)]
        row_buckets = sorted(set(rows))
        longest = self._t_bucket(min(a.max_batched_tokens, self.context_length))
        t_buckets = [t for t in (1 << i for i in range(32)) if MIN_PREFILL_BUCKET <= t <= longest]
        plan = [(b, 1) for b in row_buckets]
        plan += [(1, t) for t in t_buckets]
        budget = a.max_batched_tokens
        plan += [(n, t) for n in row_buckets if n > 1 for t in t_buckets if n * t <= budget]
        return plan

    def warm_up(self) -> WarmupReport:
        """Compile, without running a step, every executable ``shape_plan`` needs (the forward's
        and the samplers'), so no request after this waits for a compile. Idempotent: shapes
        already compiled in this process cost a lookup."""
        start = time.perf_counter()
        before = EXECUTABLES.stats().built
        plan = self.shape_plan()
        self.runner.compile(plan)
        compiled = EXECUTABLES.stats().built - before
        return WarmupReport(tuple(plan), compiled, time.perf_counter() - start)

    # ----------------------------------------------------------------- hooks: admission

    def _register(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if not req.input_ids:
            raise ValueError("empty prompt")
        if min(req.input_ids) < 0 or max(req.input_ids) >= self.config.vocab_size:
            raise ValueError("prompt token id outside the vocabulary")
        if len(req.input_ids) >= self.context_length:
            raise ValueError(
                f"prompt of {len(req.input_ids)} tokens does not fit the context length "
                f"{self.context_length}"
            )
        self.page_budget.check_fits(req)
        req.state = ReqState.WAITING
        req.seed = (
            req.sampling.seed if req.sampling.seed is not None else self._seed_rng.getrandbits(32)
        )
        req.detokenizer = self.outputs.detokenizer(req.sampling)
        if req.sampling.constraint is not None:  # GrammarError (a ValueError) if it is bad
            compiler = compiler_for(self.tokenizer, self.config.vocab_size)
            compiler.check(req.sampling.constraint)
            req.matcher = compiler.matcher(req.sampling.constraint)
        if req.resumed:
            self.outputs.replay(req)
        self.reqs[req.rid] = req

    def _process_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if isinstance(item, tuple):
                self.abort(*item)
                continue
            try:
                self.add_request(item)
            except ValueError as exc:
                item.finish_reason = FinishReason("abort", message=str(exc))
                item.state = ReqState.FINISHED
                self.outputs.mark(item)

    def _num_admitted(self) -> int:
        return len(self.prefilling) + len(self.running)

    def _admit_waiting(self) -> None:
        # Strict FIFO: a head request that does not fit yet blocks those behind it, so a large
        # request is not starved by a stream of small ones.
        while self.waiting and self._num_admitted() < self.args.max_running:
            req = self.waiting[0]
            if not self.page_budget.reserve(req):
                return
            self.waiting.popleft()
            req.state = ReqState.PREFILLING
            self.prefilling.append(req)

    # ----------------------------------------------------------------- hooks: prefill

    def _t_bucket(self, n: int) -> int:
        return bucket(n, MIN_PREFILL_BUCKET)

    def _build_prefill_batch(self) -> PrefillBatch | None:
        budget = self.args.max_batched_tokens
        rows: list[PrefillRow] = []
        t_max = 0
        for req in self.prefilling:
            remaining = len(req.input_ids) - req.prefilled
            cap = self._chunk_cap(req)
            if cap is not None:
                remaining = min(remaining, cap)
            if not rows:
                n = min(remaining, budget)
            else:
                n_pad = bucket(len(rows) + 1)
                if n_pad * self._t_bucket(max(t_max, remaining)) <= budget:
                    n = remaining
                elif n_pad * self._t_bucket(t_max) <= budget:
                    n = min(remaining, self._t_bucket(t_max))
                else:
                    break
            rows.append(PrefillRow(req, req.prefilled, n))
            t_max = max(t_max, n)
        if not rows:
            return None
        return PrefillBatch(tuple(rows), bucket(len(rows)), self._t_bucket(t_max))

    def _run_prefill(self, batch: PrefillBatch) -> None:
        tokens = np.zeros((batch.n_pad, batch.t_pad), np.int32)
        start = np.zeros(batch.n_pad, np.int32)
        num_new = np.zeros(batch.n_pad, np.int32)
        table = np.zeros((batch.n_pad, self.table_width), np.int32)
        for i, row in enumerate(batch.rows):
            req = row.req
            assert req.pages is not None
            tokens[i, : row.length] = req.input_ids[row.start : row.start + row.length]
            start[i], num_new[i] = row.start, row.length
            used = self.pool_config.pages_for(row.start + row.length)
            table[i, :used] = req.pages[:used]
        # Prompt log-probs need every position's logits: only batches with a row that asks for
        # them pay for the wider head (and its compile, on first use of each chunk shape).
        every_position = any(row.req.logprobs.prompt for row in batch.rows)
        logits = self.runner.forward_extend(tokens, start, num_new, table,
                                            all_logits=every_position)
        if every_position:
            self._record_prompt_logprobs(batch, logits)
            logits = last_logits(logits, num_new)

        completed: list[Req | None] = []
        for row in batch.rows:
            row.req.prefilled += row.length
            done = row.req.prefilled == len(row.req.input_ids)
            completed.append(row.req if done else None)
            if not done:
                self._on_prefill_chunk(row.req)
        if not any(completed):
            return
        self._on_logits("prefill", completed, logits)
        sampled, logprobs = self.runner.sample(logits, completed)
        tops = self.runner.top_logprobs(logits, completed)
        for done_req, token, logprob, top in zip(completed, sampled, logprobs, tops, strict=True):
            if done_req is not None:
                self._on_prefill_done(done_req, int(token), float(logprob), top)

    def _chunk_cap(self, req: Req) -> int | None:
        """The most tokens of ``req`` one prefill forward may take (None: the batch's budget
        alone). Hook: P caps a room whose KV it streams."""
        return None

    def _on_prefill_chunk(self, req: Req) -> None:
        """A chunk of ``req``'s prompt was prefilled, not the last one. Hook: P streams the
        chunk's KV to D."""

    def _record_prompt_logprobs(self, batch: PrefillBatch, logits: jax.Array) -> None:
        """Append, for each row that asks, the log-prob of every prompt token this chunk
        predicts (position ``p`` predicts token ``p + 1``) from ``logprobs.prompt_from`` on."""
        next_ids = np.zeros((batch.n_pad, batch.t_pad), np.int32)
        for i, row in enumerate(batch.rows):
            ids = row.req.input_ids[row.start + 1 : row.start + row.length + 1]
            next_ids[i, : len(ids)] = ids
        top = any(row.req.logprobs.top for row in batch.rows if row.req.logprobs.prompt)
        chosen, top_ids, top_values = prompt_logprobs(logits, next_ids, top)
        for i, row in enumerate(batch.rows):
            req, spec = row.req, row.req.logprobs
            if not spec.prompt:
                continue
            if row.start == 0 and spec.prompt_from == 0:
                req.prompt_logprobs.append(None)  # nothing predicts the first token
                if spec.top:
                    req.prompt_top.append(None)
            for j in range(row.length):
                position = row.start + j + 1
                if position >= len(req.input_ids):
                    break  # the last position predicts the first output token
                if position < spec.prompt_from:
                    continue
                req.prompt_logprobs.append(float(chosen[i, j]))
                if spec.top:
                    req.prompt_top.append(tuple(zip(top_ids[i, j, : spec.top].tolist(),
                                                    top_values[i, j, : spec.top].tolist(),
                                                    strict=True)))
            if row.start + row.length == len(req.input_ids):
                req.prompt_logprobs_ready = True

    def _on_prefill_done(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        """The whole prompt is in the pool and the first token is sampled."""
        self.prefilling.remove(req)
        self._enter_running(req, first_token, first_logprob, first_top)

    def _enter_running(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        forks = self._fork(req)
        if req.sampling.max_new_tokens == 0:
            for seq in (req, *forks):
                self._finish(seq, FinishReason("length"))
            return
        req.state = ReqState.RUNNING
        self.running.append(req)
        self.running.extend(forks)
        self._append_token(req, first_token, first_logprob, first_top)

    def _fork(self, req: Req) -> list[Req]:
        """Sampling n > 1: sequences 1..n-1 of ``req``, which has just been prefilled (here or
        on P). They share the prompt's pages before the one holding its last token; each gets
        its own copy of that page (copy-on-write: it rewrites that position's KV with its first
        step, which samples its first token from the prompt's last logits with its own seed)."""
        n = req.sampling.n
        if n == 1 or req.family:
            return []
        split = self.page_budget.fork(req)
        assert req.pages is not None
        forks: list[Req] = []
        for i, pages in enumerate(split.forks, start=1):
            fork = Req(req.rid, req.input_ids, req.sampling, req.metadata,
                       attrs.evolve(req.logprobs, prompt_from=-1))
            fork.index, fork.parent = i, req
            fork.pages = pages
            fork.prefilled = len(req.input_ids)
            fork.state = ReqState.RUNNING
            fork.seed = (req.seed + i) & 0xFFFFFFFFFFFFFFFF
            fork.detokenizer = self.outputs.detokenizer(req.sampling)
            fork.matcher = None if req.matcher is None else req.matcher.fork()
            forks.append(fork)
        src = np.full(n - 1, req.pages[split.copied], np.int32)
        dst = np.array([pages[split.copied] for pages in split.forks], np.int32)
        self.runner.copy_pages(src, dst)
        req.family = [req, *forks]
        return forks

    # ----------------------------------------------------------------- hooks: decode

    def _build_decode_batch(self) -> DecodeBatch | None:
        if not self.running:
            return None
        reqs = tuple(self.running)
        return DecodeBatch(reqs, bucket(len(reqs)))

    def _run_decode(self, batch: DecodeBatch) -> None:
        tokens = np.zeros(batch.b_pad, np.int32)
        positions = np.zeros(batch.b_pad, np.int32)
        table = np.zeros((batch.b_pad, self.table_width), np.int32)
        for i, req in enumerate(batch.reqs):
            assert req.pages is not None
            tokens[i] = req.last_token
            positions[i] = req.seq_len - 1  # the last sampled token is fed now
            used = self.pool_config.pages_for(req.seq_len)
            table[i, :used] = req.pages[:used]
        lengths = np.where(np.arange(batch.b_pad) < len(batch.reqs), positions + 1, 0)
        logits = self.runner.forward_decode(tokens, positions, table,
                                            lengths.astype(np.int32))
        rows: list[Req | None] = list(batch.reqs)
        self._on_logits("decode", rows, logits)
        sampled, logprobs = self.runner.sample(logits, rows)
        tops = self.runner.top_logprobs(logits, rows)
        for req, token, logprob, top in zip(batch.reqs, sampled, logprobs, tops, strict=True):
            self._append_token(req, int(token), float(logprob), top)

    # ----------------------------------------------------------------- hooks: tokens and finish

    def _on_logits(self, phase: str, reqs: Sequence[Req | None], logits: jax.Array) -> None:
        """Called with each forward's logits ``[B_pad, V]`` before sampling (row ``i`` belongs to
        ``reqs[i]``; None rows are padding or unfinished chunks). No-op; for checks and tests."""

    def _append_token(
        self, req: Req, token: int, logprob: float, top: TopLogprobs = ()
    ) -> None:
        reason = self.outputs.append_token(req, token, logprob, top)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.state is ReqState.FINISHED:
            return
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        if all(seq.finished for seq in req.root.family or [req]):
            self.reqs.pop(req.rid, None)  # the request is over when its last sequence is
        self._detach(req)
        self.page_budget.release(req)
        self.outputs.mark(req)

    def _detach(self, req: Req) -> None:
        """Remove ``req`` from every queue it may be in (mixins extend this with their own)."""
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

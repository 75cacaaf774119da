"""The colocated scheduler: continuous batching of prefill and decode over the paged KV pool.

Synchronous and single-threaded: a caller (the HTTP worker's thread, a test, a benchmark) calls
``step()``, which runs at most one prefill forward and one decode forward and returns the outputs
they produced. One thread drives it; only ``submit`` and ``request_abort`` may be called from other
threads (they queue work that the next ``step()`` applies).

Plan apart from run: the queues (``self.queues``, queues.py) say which requests are
waiting, prefilling and running; each step plans a prefill batch and a decode batch as plain data
(plan.py), the ``ModelRunner`` (``self.runner``) runs each plan under the KV holder's lock (DESIGN
§6) and samples, and the scheduler applies what came back: the ``OutputProcessor``
(``self.outputs``) turns each token into text and says why a request ends, ``finish`` ends it.
Pages are the ``PageBudget``'s (``self.page_budget``): reserved for ``prompt + max_new_tokens``
tokens when a request is admitted (no preemption), released exactly once, in ``finish``.

The role (``self.role``, role.py) is what a prefill or decode worker adds: an object called at
named points of the step (P hands a prefilled room's KV to D instead of decoding it; D enters a
transferred request into the decode batch with ``add_prefilled_request``, skipping the prefill
forward). The colocated role adds nothing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import attrs
import jax

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.model import LoadedModel, load_model, table_width
from pd_fsm.jax_engine.parallel.tensor_parallel import check_tp
from pd_fsm.jax_engine.sampling.grammar import compiler_for
from pd_fsm.jax_engine.sampling.params import SamplingParams, TopLogprobs
from pd_fsm.schedulers.args import SchedulerArgs, prefill_budget, weights_dtype
from pd_fsm.schedulers.forks import fork_sequences
from pd_fsm.schedulers.model_runner import Launched, ModelRunner, StepResult
from pd_fsm.schedulers.output_processor import OutputProcessor
from pd_fsm.schedulers.page_budget import PageBudget
from pd_fsm.schedulers.plan import (
    MIN_PREFILL_BUCKET,
    DecodeBatch,
    PrefillBatch,
    PrefillRow,
    plan_decode,
    plan_prefill,
)
from pd_fsm.schedulers.queues import RequestQueues
from pd_fsm.schedulers.request import (
    FinishReason,
    LogprobSpec,
    Req,
    ReqState,
    RequestOutput,
    Resume,
)
from pd_fsm.schedulers.role import ColocatedRole, SchedulerRole

__all__ = [
    "MIN_PREFILL_BUCKET",
    "DecodeBatch",
    "PrefillBatch",
    "PrefillRow",
    "Scheduler",
    "SchedulerStats",
]


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
    """``role``: builds this scheduler's role from the scheduler (its last act of construction:
    the role may use every public name here); default the colocated one."""

    def __init__(
        self,
        args: SchedulerArgs,
        *,
        model: LoadedModel | None = None,
        role: Callable[[Scheduler], SchedulerRole] | None = None,
    ) -> None:
        # How steps run on this backend and this many devices (jax_engine/backend.py).
        self.backend = backend.current().for_tp(args.tp_size)
        # --max-batched-tokens resolved (None: this backend's default), as every reader of the
        # arguments sees it.
        self.max_batched_tokens = prefill_budget(args.max_batched_tokens)
        self.args = args = attrs.evolve(args, max_batched_tokens=self.max_batched_tokens,
                                        dtype=weights_dtype(args.dtype))
        self.model = model if model is not None else load_model(
            args.model, args.dtype, args.model_seed, args.load_format
        )
        self.config = self.model.config
        check_tp(self.config, args.tp_size, len(jax.devices()))
        self.tokenizer = self.model.tokenizer
        self.eos_token_ids = self.model.eos_token_ids
        self.pool_config = attrs.evolve(
            self.config.kv_pool_config(args.num_pages, args.page_size, args.kv_dtype),
            lanes=self.backend.kv_lanes, bf16_bits=self.backend.bf16_bits)
        limit = args.context_length or self.config.max_position
        self.context_length = min(limit, self.config.max_position)
        # The pages: allocator, prefix cache, what each request needs (the role says whose
        # forks are not this worker's: a P worker's rooms fork on D).
        self.page_budget = PageBudget(self.pool_config, args.num_pages, self.context_length,
                                      radix_cache=args.radix_cache,
                                      forks_here=lambda req: self.role.forks_here(req))
        # Every forward's page table has this width (the longest sequence admitted, in whole
        # context chunks), so the compiled shapes are the batch buckets alone.
        longest = min(self.pool_config.pages_for(self.context_length), args.num_pages - 1)
        self.table_width = table_width(longest, args.page_size)
        # The weights on this instance's devices, the pool, the forwards and sampling.
        self.runner = ModelRunner(self.model, self.pool_config, self.table_width, args.tp_size,
                                  self.backend, args.max_running)
        self.kv_holder = self.runner.kv_holder  # the PD roles gather and scatter rooms' KV in it
        self.queues = RequestQueues()
        # The queues under their own names (the same objects: never rebound).
        self.reqs, self.waiting = self.queues.reqs, self.queues.waiting
        self.prefilling, self.running = self.queues.prefilling, self.queues.running
        self.forward_shapes = self.runner.forward_shapes  # every padded shape run so far
        # The sampled tokens' text, stop conditions and the outputs not drained yet.
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.context_length)
        self._seed_rng = random.Random(args.random_seed)
        # A decode step dispatched and not yet read (the backend overlaps steps): read, and its
        # tokens applied, once the next step is on its way.
        self._inflight: Launched | None = None
        self.role: SchedulerRole = ColocatedRole() if role is None else role(self)

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
        self.register(req)
        self.waiting.append(req)

    def add_prefilled_request(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        """Enter ``req`` straight into the decode batch: its prompt's K/V is already in
        ``req.pages`` (e.g. transferred from a prefill worker) and its first token is sampled."""
        if req.rid not in self.reqs:
            self.register(req)
        if req.pages is None or len(req.pages) < self.page_budget.pages_needed(req):
            raise ValueError(f"request {req.rid} entered decode without its pages reserved")
        self.queues.remove(req)
        req.prefilled = len(req.input_ids)
        self._enter_running(req, first_token, first_logprob, first_top)

    def submit(self, req: Req) -> None:
        """Thread-safe ``add_request``: queued for the next ``step()``. A request that can never
        be served is then finished with an abort output carrying the reason."""
        self.queues.put(req)

    def request_abort(self, rid: str, message: str = "aborted") -> None:
        """Thread-safe ``abort``: applied at the start of the next ``step()``."""
        self.queues.put((rid, message))

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Finish a live request (every sequence of it) with an abort reason and free its
        pages; False if unknown. What the role holds (a live PD room) it aborts itself."""
        if self.role.abort(rid, message):
            return True
        req = self.reqs.get(rid)
        if req is None:
            return False
        for seq in req.family or [req]:
            self.finish(seq, FinishReason("abort", message=message))
        return True

    def step(
        self, early: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """One scheduling iteration: plan a prefill batch, run it, apply it; the same for a
        decode batch. Returns the outputs produced since the previous call.

        ``early``: if given, and a decode forward is to run while outputs are pending (a
        prompt's first token, prefilled here or pulled from P), those go to ``early`` and not in
        the returned list: once that forward is launched where the backend overlaps steps (the
        device runs it while they go out), before it where it runs whole. Without it a first
        token waited for the step's decode forward (a whole inter-token interval, ~50 ms for
        SmolLM2 on this machine) before its client saw it; sglang likewise streams a prefill
        batch's tokens before running the next decode batch."""
        self.role.before_step()
        for item in self.queues.take_inbox():
            if isinstance(item, tuple):
                self.abort(*item)
                continue
            try:
                self.add_request(item)
            except ValueError as exc:
                item.finish_reason = FinishReason("abort", message=str(exc))
                item.state = ReqState.FINISHED
                self.outputs.mark(item)
        for req in self.queues.admit(self.page_budget, self.args.max_running):
            self.role.on_admitted(req)
        prefill = plan_prefill(self.prefilling, self.max_batched_tokens,
                               self.role.chunk_cap)
        if prefill is not None:
            self._prefill(prefill)
        decode = plan_decode(self.running)
        flush = None
        if decode is not None and early is not None and self.outputs.pending:
            flush = lambda: early(self.drain_outputs())  # noqa: E731
        self._decode(decode, flush)
        outputs = self.drain_outputs()
        self.role.after_step()
        return outputs

    def drain_outputs(self) -> list[RequestOutput]:
        return self.outputs.drain(self.reqs)

    def has_forward_work(self) -> bool:
        """Whether a step would run a forward or return an output (the role's own work, e.g.
        D's transfers in flight, aside)."""
        return self.queues.busy or self.outputs.pending or self._inflight is not None

    def has_work(self) -> bool:
        return self.has_forward_work() or self.role.has_work()

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

    # ----------------------------------------------------------------- a request's life

    def register(self, req: Req) -> None:
        """Make ``req`` live here (seeded, its detokenizer and grammar ready), in no queue yet;
        raises ``ValueError`` for one that can never be served."""
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

    def finish(self, req: Req, reason: FinishReason | None) -> None:
        """End one sequence (no-op for None or one already finished): out of every queue, its
        pages released, an output marked."""
        if reason is None or req.state is ReqState.FINISHED:
            return
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        if all(seq.finished for seq in req.root.family or [req]):
            self.reqs.pop(req.rid, None)  # the request is over when its last sequence is
        self.queues.remove(req)
        self.page_budget.release(req)
        self.outputs.mark(req)

    def _enter_running(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        forks = fork_sequences(req, self.page_budget, self.runner, self.outputs)
        if req.sampling.max_new_tokens == 0:
            for seq in (req, *forks):
                self.finish(seq, FinishReason("length"))
            return
        req.state = ReqState.RUNNING
        self.running.append(req)
        self.running.extend(forks)
        self.finish(req, self.outputs.append_token(req, first_token, first_logprob, first_top))

    # ----------------------------------------------------------------- running a plan

    def _prefill(self, batch: PrefillBatch) -> None:
        """Run ``batch`` and apply it: prompt log-probs, each chunk's progress, and for each
        completed prompt its first token (decoded here unless the role takes the request)."""
        completed: list[Req | None] = [
            row.req if row.start + row.length == len(row.req.input_ids) else None
            for row in batch.rows]
        started = time.monotonic()
        for row in batch.rows:
            if row.req.prefill_started is None:
                row.req.prefill_started = started
        result = self.runner.prefill_step(batch, completed)
        done = time.monotonic()
        for req in completed:
            if req is not None:
                req.first_token_at = done
        if result.every_position is not None:
            self.outputs.record_prompt_logprobs(batch, result.every_position)
        for row, req in zip(batch.rows, completed, strict=True):
            row.req.prefilled += row.length
            if req is None:
                self.role.on_prefill_chunk(row.req)
        if not any(completed):
            return
        self._on_logits("prefill", completed, result.logits)
        for req, token, logprob, top in zip(completed, result.tokens, result.logprobs,
                                            result.tops, strict=True):
            if req is None or self.role.take_prefilled(req, int(token), float(logprob), top):
                continue
            self.prefilling.remove(req)
            self._enter_running(req, int(token), float(logprob), top)

    def _decode(self, batch: DecodeBatch | None, flush: Callable[[], None] | None = None
                ) -> None:
        """Run ``batch`` (None: none) and append each sequence's sampled token. Where the
        backend overlaps steps, the step is dispatched first and the one before it (still in
        flight) read and applied while it runs: a sequence's token then reaches its output one
        step later, and a sequence that finished in the step read has one more token computed,
        then dropped. ``flush`` (``step``'s early outputs) runs once the step is dispatched, or
        before a step run whole."""

        def append(reqs: Sequence[Req], result: StepResult) -> None:
            for req, token, logprob, top in zip(reqs, result.tokens, result.logprobs,
                                                result.tops, strict=True):
                if req.state is not ReqState.RUNNING:
                    continue  # finished (aborted, handed off) while its step was in flight
                self.finish(req, self.outputs.append_token(req, int(token), float(logprob),
                                                           top))

        previous, self._inflight = self._inflight, None
        if batch is not None and self.runner.can_overlap(batch.reqs):
            self._inflight = self.runner.decode_launch(batch, previous)
        if flush is not None:
            flush()
        if previous is not None:
            append(previous.reqs, self.runner.collect(previous))
            if self._inflight is None:
                batch = plan_decode(self.running)  # some rows may have finished in it
        if batch is None or self._inflight is not None:
            return
        result = self.runner.decode_step(batch)
        self._on_logits("decode", list(batch.reqs), result.logits)
        append(batch.reqs, result)

    def _on_logits(self, phase: str, reqs: Sequence[Req | None], logits: jax.Array | None
                   ) -> None:
        """Called with each forward's logits ``[B_pad, V]`` before sampling (row ``i`` belongs to
        ``reqs[i]``; None rows are padding or unfinished chunks), None after a fused step (which
        returns tokens only). No-op; for checks and tests."""

"""The accelerator's step on a CPU: pd_fsm's ragged paged attention kernel (Pallas interpret
mode) against its XLA reference, the fused step against the chain of jitted calls, and the
scheduler on the accelerator's backend choices against the CPU's.

On a TPU the kernel tests compile the kernel for the chip instead (``interpret`` follows the
backend) and run there; ``bench/bench_engine.py``'s kernel check does the same at the served
shapes."""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.attention.ragged_paged import decode_block_q, ragged_paged_attention
from pd_fsm.jax_engine.attention.reference import ragged_attention_reference
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.kv.pool import allocate_kv_pool
from pd_fsm.jax_engine.model import TINY, LoadedModel, decode, extend
from pd_fsm.jax_engine.model.params import fuse_projections, random_params, stack_layers
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.jax_engine.step.program import StepOptions, step
from pd_fsm.schedulers import Req, RequestOutput, Scheduler, SchedulerArgs, model_runner
from pd_fsm.schedulers.model_runner import MAIN_KV
from pd_fsm.schedulers.request import LogprobSpec
from pd_fsm.schedulers.warm_up import shapes_of, warm_up
from pd_fsm.text.tokenizer import CharTokenizer

INTERPRET = jax.default_backend() != "tpu"
PAGE = 16


def _case(nh: int, nkv: int, d: int, dtype: str, q_lens: list[int], kv_lens: list[int],
          seqs: int, tokens: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """A pool of random pages, each sequence's pages drawn at random, random queries."""
    rng = np.random.default_rng(seed)
    pages = 48
    pool = jnp.asarray(rng.standard_normal((pages, PAGE, 2 * nkv * d)), dtype)
    q_l = np.zeros(seqs, np.int32)
    kv_l = np.zeros(seqs, np.int32)
    q_l[: len(q_lens)], kv_l[: len(kv_lens)] = q_lens, kv_lens
    table = np.zeros((seqs, 8), np.int32)
    free = list(rng.permutation(np.arange(1, pages)))
    for s, n in enumerate(kv_lens):
        for j in range(-(-n // PAGE)):
            table[s, j] = free.pop()
    q = jnp.asarray(rng.standard_normal((tokens, nh, d)), dtype)
    return q, pool, jnp.asarray(q_l), jnp.asarray(kv_l), jnp.asarray(table)


# heads, kv-heads, head_dim, dtype, q_lens, kv_lens, padded sequences, padded tokens
CASES = [
    # decode rows: one of a single token, several pages, a page boundary; a padding sequence
    (4, 2, 128, "float32", [1, 1, 1], [1, 100, 33], 4, 4),
    # a prompt over several work items and blocks, a chunk after cached context, a decode row
    (4, 2, 128, "float32", [20, 8, 1], [20, 50, 40], 3, 32),
    # head_dim 64 (a kv-head's K and V in one 128-lane slot), 3 query heads per kv-head (the
    # count JAX's kernel refuses: SmolLM2's), bf16
    (9, 3, 64, "bfloat16", [17, 1, 5], [17, 70, 128], 4, 28),
    (8, 8, 64, "float32", [1, 12], [9, 60], 2, 16),
    # one decode row in a step padded to the runner's capacity (the grid's unused steps fetch
    # and write back nothing: the last item's block stays put)
    (4, 2, 128, "float32", [1, 1], [70, 5], 16, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-kv{c[1]}-d{c[2]}-{c[3]}")
@pytest.mark.parametrize("unroll_dma", [False, True])
def test_the_kernel_equals_the_reference(case: tuple, unroll_dma: bool) -> None:  # type: ignore[type-arg]
    nh, nkv, d, dtype, q_lens, kv_lens, seqs, tokens = case
    q, pool, q_l, kv_l, table = _case(nh, nkv, d, dtype, q_lens, kv_lens, seqs, tokens)
    block_q = decode_block_q(nh // nkv, dtype)
    got = ragged_paged_attention(q, pool, q_l, kv_l, table, block_q=block_q, block_pages=2,
                                 interpret=INTERPRET, unroll_dma=unroll_dma)
    with jax.default_matmul_precision("highest"):
        ref = ragged_attention_reference(q, pool, q_l, kv_l, table)
    n = sum(q_lens)
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-5  # bf16: p is rounded before p @ V
    np.testing.assert_allclose(np.asarray(got[:n], np.float32), np.asarray(ref[:n], np.float32),
                               atol=tolerance, rtol=tolerance)
    # Padding tokens come back as zeros: their K/V lands in the null page, which every path that
    # reads it masked needs finite.
    assert not np.any(np.asarray(got[n:], np.float32))


def test_a_larger_query_block_gives_the_same_answer() -> None:
    q, pool, q_l, kv_l, table = _case(4, 2, 128, "float32", [20, 8, 1], [20, 50, 40], 3, 32)
    small = ragged_paged_attention(q, pool, q_l, kv_l, table, block_q=8, block_pages=1,
                                   interpret=INTERPRET)
    large = ragged_paged_attention(q, pool, q_l, kv_l, table, block_q=16, block_pages=3,
                                   interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(small[:29]), np.asarray(large[:29]), atol=1e-5)


def test_a_block_size_that_does_not_tile_is_refused() -> None:
    q, pool, q_l, kv_l, table = _case(9, 3, 64, "bfloat16", [1], [5], 1, 1)
    with pytest.raises(ValueError, match="does not tile"):
        ragged_paged_attention(q, pool, q_l, kv_l, table, block_q=8, block_pages=1,
                               interpret=INTERPRET)


def _model(head_dim: int = 64) -> LoadedModel:
    config = attrs.evolve(TINY, head_dim=head_dim, num_heads=4, num_kv_heads=2)
    return LoadedModel(f"tiny-d{head_dim}", config, random_params(config, 0),
                       CharTokenizer(256, eos_token_id=0))


@pytest.mark.parametrize("attention", ["reference", "interpret"])
def test_the_fused_step_gives_the_chains_logits(attention: str) -> None:
    """Two prompts prefilled in one ragged step, then two decode steps: the last tokens'
    logits equal the chain's (model/forward.py), the KV written where the chain writes it."""
    model = _model()
    config, params = model.config, model.params
    pool = config.kv_pool_config(24, PAGE)
    chain_kv = allocate_kv_pool(pool)
    fused_kv = allocate_kv_pool(attrs.evolve(pool, lanes=True, bf16_bits=False))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 256, 5), rng.integers(1, 256, 19)]
    table = np.zeros((2, 4), np.int32)
    table[0, :1], table[1, :2] = [3], [7, 1]
    tokens = np.zeros((2, 32), np.int32)
    tokens[0, :5], tokens[1, :19] = prompts
    options = StepOptions(config, attention=attention)  # type: ignore[arg-type]

    want, chain_kv = extend(params, chain_kv, jnp.asarray(tokens), jnp.zeros(2, jnp.int32),
                            jnp.asarray([5, 19], jnp.int32), jnp.asarray(table), config=config)
    ragged = np.zeros(32, np.int32)
    ragged[:5], ragged[5:24] = prompts
    lens = jnp.asarray([5, 19], jnp.int32)
    (got,), fused_kv = step(params, fused_kv, jnp.asarray(ragged), lens, lens,
                            jnp.asarray(table), {}, options=options, sampler="logits")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    for position, fed in ((5, [11, 12]), (6, [13, 14])):
        start = jnp.asarray([position, position + 14], jnp.int32)
        want, chain_kv = decode(params, chain_kv, jnp.asarray(fed, jnp.int32), start,
                                jnp.asarray(table), start + 1, config=config)
        (got,), fused_kv = step(params, fused_kv, jnp.asarray(fed, jnp.int32),
                                jnp.ones(2, jnp.int32), start + 1, jnp.asarray(table), {},
                                options=options, sampler="logits")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    used = [3, 7, 1]  # the null page aside: padding writes there, each path its own values
    for a, b in zip(chain_kv, fused_kv, strict=True):
        np.testing.assert_allclose(np.asarray(a).reshape(b.shape)[used], np.asarray(b)[used],
                                   atol=1e-5)
    (sampled, logprobs), _ = step(params, fused_kv, jnp.asarray([1, 2], jnp.int32),
                                  jnp.ones(2, jnp.int32), jnp.asarray([8, 22], jnp.int32),
                                  jnp.asarray(table), {}, options=options, sampler="greedy")
    assert sampled.shape == logprobs.shape == (2,) and np.all(np.asarray(logprobs) <= 0)


def _prompt_step(model: LoadedModel, params: dict[str, Any]) -> tuple[np.ndarray, list[Any]]:
    """One 8-token prompt's step over ``params`` (``model``'s weights in some form): its logits
    and the pool it wrote."""
    config = model.config
    pool = attrs.evolve(config.kv_pool_config(8, PAGE), lanes=True, bf16_bits=False)
    args = (jnp.arange(1, 9, dtype=jnp.int32), jnp.asarray([8], jnp.int32),
            jnp.asarray([8], jnp.int32), jnp.asarray([[2]], jnp.int32), {})
    (logits,), kv = step(params, allocate_kv_pool(pool), *args,
                         options=StepOptions(config, attention="reference"), sampler="logits")
    return np.asarray(logits), [np.asarray(layer) for layer in kv]


def test_fused_projections_give_the_same_step() -> None:
    model = _model(head_dim=128)
    fused = fuse_projections(model.params)
    assert "wqkv" in fused["layers"][0] and "wq" not in fused["layers"][0]
    np.testing.assert_allclose(_prompt_step(model, model.params)[0],
                               _prompt_step(model, fused)[0], atol=1e-5)


def test_stacked_layers_give_the_same_step() -> None:
    """The layers' weights stacked (one array per name, ``[L, ...]``): the same logits and
    pool, from ~11 weight arguments instead of ~11 a layer."""
    model = _model(head_dim=128)
    stacked = stack_layers(model.params)
    assert stacked["layers"]["wq"].shape[0] == model.config.num_layers
    assert len(jax.tree.leaves(stacked["layers"])) == len(model.params["layers"][0])
    (a, kv_a), (b, kv_b) = _prompt_step(model, model.params), _prompt_step(model, stacked)
    np.testing.assert_array_equal(a, b)
    for x, y in zip(kv_a, kv_b, strict=True):
        np.testing.assert_array_equal(x, y)
    mixed = {**model.params, "layers": [model.params["layers"][0],
                                        {"router": None, **model.params["layers"][1]}]}
    with pytest.raises(ValueError, match="cannot be stacked"):
        stack_layers(mixed)


PROMPTS = ["hello world, this is a test of the fused step", "short", "x" * 40,
           "another prompt here"]


def _generate(sched: Scheduler, penalized: bool = False) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 == 0 else 0.8, seed=7,
                            repetition_penalty=1.3 if penalized and i == 1 else 1.0)
        sched.add_request(sched.make_request(f"r{i}", prompt, sp))
    out: dict[str, list[int]] = {}
    for o in sched.run_until_idle():
        out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


def test_the_scheduler_on_the_accelerators_choices_answers_as_on_the_cpus() -> None:
    """The same requests (greedy and seeded sampling, prompts chunked by a 32-token budget,
    some ending at EOS before their limit) through the scheduler three ways: the chain over the
    heads pool; the accelerator's fused step over a lanes pool, each decode step dispatched
    before the previous one's tokens are read (the default there); and the fused step one step
    at a time. Attention by the XLA reference, so that this stays quick. Equal tokens; after its
    warm-up (a step shape per token count) the fused scheduler compiles nothing; a penalized
    request (whose choice needs the logits on the host) takes the chain on the same pool and
    still answers alike."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=PAGE, max_running=4,
                         max_batched_tokens=32, context_length=128)
    chain = _generate(Scheduler(args, model=model))
    chain_penalized = _generate(Scheduler(args, model=model), penalized=True)
    accelerator = backend.accelerator_on_cpu("reference")
    assert accelerator.overlap_steps
    with backend.using(accelerator):
        sched = Scheduler(args, model=model)
        assert sched.pool_config.lanes and sched.runner.backend.fused_step
        warm_up(sched)
        built = EXECUTABLES.stats().built
        assert _generate(sched) == chain
        assert EXECUTABLES.stats().built == built
        assert all(shape[0] == "step" for shape in sched.forward_shapes)
        # One step shape per token count (the sequences at the runner's capacity): fewer than
        # the planner's (rows, tokens) shapes, and every step ran at one of them.
        steps = sched.runner.step_shapes(shapes_of(sched))
        assert len(steps) < len(shapes_of(sched))
        assert {shape[1:] for shape in sched.forward_shapes} <= set(steps)
        assert _generate(Scheduler(args, model=model), penalized=True) == chain_penalized
    with backend.using(attrs.evolve(accelerator, overlap_steps=False)):
        assert _generate(Scheduler(args, model=model)) == chain


PENALTIES = [
    SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=2.0),
    SamplingParams(max_new_tokens=14, temperature=0.9, seed=5, frequency_penalty=1.5),
    SamplingParams(max_new_tokens=14, temperature=0.0, presence_penalty=1.0,
                   frequency_penalty=-0.5, min_new_tokens=6),
    SamplingParams(max_new_tokens=14, temperature=0.7, seed=9, repetition_penalty=0.7,
                   presence_penalty=0.5),
]


def _penalized(sched: Scheduler, samplings: list[SamplingParams]) -> dict[str, list[int]]:
    for i, sp in enumerate(samplings):
        sched.add_request(sched.make_request(f"p{i}", PROMPTS[i % len(PROMPTS)], sp))
    out: dict[str, list[int]] = {}
    for o in sched.run_until_idle():
        out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


def test_penalties_and_bans_on_the_device_answer_as_the_chain() -> None:
    """Frequency, presence and repetition penalties and ``min_new_tokens``' bans, greedy and
    seeded, five requests at once through the fused step (each decode step dispatched before
    the last one's tokens are read, and one step at a time): the chain's tokens, with no chain
    forward run — the counts live on the device, a slot a request, the ban in the step's
    bitmask; every slot back once the requests finished. Without the penalties the tokens
    differ, and the ban holds back a stop token the request would otherwise end on, so this
    compares something."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=8,
                         max_batched_tokens=64, context_length=128)
    plain = [attrs.evolve(sp, repetition_penalty=1.0, frequency_penalty=0.0,
                          presence_penalty=0.0, min_new_tokens=0) for sp in PENALTIES]
    unbanned = SamplingParams(max_new_tokens=14, temperature=0.0)
    free = _penalized(Scheduler(args, model=model), [*plain, unbanned])
    # The last one: told to stop on the token the free run chose second, banned from it until
    # its ninth.
    banned = attrs.evolve(unbanned, stop_token_ids=[free["p4"][1]], min_new_tokens=9)
    samplings = [*PENALTIES, banned]
    chain = _penalized(Scheduler(args, model=model), samplings)
    assert [chain[f"p{i}"] != free[f"p{i}"] for i in range(4)].count(True) >= 3
    assert len(chain["p4"]) >= 9 and chain["p4"][:2] != free["p4"][:2]
    accelerator = backend.accelerator_on_cpu("reference")
    for overlap in (True, False):
        with backend.using(attrs.evolve(accelerator, overlap_steps=overlap)):
            sched = Scheduler(args, model=model)
            assert _penalized(sched, samplings) == chain
            assert all(shape[0] == "step" for shape in sched.forward_shapes)
            slots = sched.runner.rows.slots
            assert slots is not None and slots.held() <= len(PENALTIES)
            assert slots.fit([None] * 8) and len(slots._free) + slots.held() == 8


def _with_tops(sched: Scheduler) -> dict[str, list[object]]:
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(max_new_tokens=6, temperature=0.0 if i % 2 else 0.8, seed=3,
                            frequency_penalty=0.5 if i == 2 else 0.0)
        sched.add_request(sched.make_request(f"t{i}", prompt, sp,
                                             logprobs=LogprobSpec(top=5 if i < 3 else 0)))
    out: dict[str, list[object]] = {}
    for o in sched.run_until_idle():
        out.setdefault(o.rid, []).extend(zip(o.new_token_ids, o.new_logprobs,
                                             o.new_top_logprobs or [()] * len(o.new_token_ids),
                                             strict=True))
    return out


def test_top_logprobs_on_the_device_answer_as_the_chain() -> None:
    """Rows asking for their top alternatives (one penalized, one sampled) beside one that does
    not, through the fused step overlapped: the chain's tokens, and the same alternatives with
    the same log-probs (to float rounding: the step's logits are another program's), from no
    chain forward."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=PAGE, max_running=4,
                         max_batched_tokens=32, context_length=128)
    chain = _with_tops(Scheduler(args, model=model))
    with backend.using(backend.accelerator_on_cpu("reference")):
        sched = Scheduler(args, model=model)
        fused = _with_tops(sched)
        assert all(shape[0] == "step" for shape in sched.forward_shapes)
    assert fused.keys() == chain.keys()
    for rid, rows in chain.items():
        assert [t for t, _, _ in fused[rid]] == [t for t, _, _ in rows]
        np.testing.assert_allclose([lp for _, lp, _ in fused[rid]], [lp for _, lp, _ in rows],
                                   atol=1e-4)
        for (_, _, top_f), (_, _, top_c) in zip(fused[rid], rows, strict=True):
            assert [i for i, _ in top_f] == [i for i, _ in top_c]  # type: ignore[attr-defined]
            np.testing.assert_allclose([v for _, v in top_f], [v for _, v in top_c],  # type: ignore[attr-defined]
                                       atol=1e-4)
    assert all(len(top) == 5 for _, _, top in chain["t0"])  # type: ignore[arg-type]


def test_a_prefill_of_a_few_prompts_runs_at_eight_sequences_not_the_capacity() -> None:
    """A 16-row runner's prefill steps: one prompt alone runs at 8 sequences, twelve short
    prompts batched into one step at the capacity's 16; both shapes compiled by the warm-up,
    nothing after it, and the tokens the chain's."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                         max_batched_tokens=256, context_length=64)
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)

    def run(sched: Scheduler) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for batch in (["a lone prompt"], [f"p{i}" for i in range(12)]):
            for prompt in batch:
                sched.add_request(sched.make_request(prompt, prompt, greedy))
            for o in sched.run_until_idle():
                out.setdefault(o.rid, []).extend(o.new_token_ids)
        return out

    chain = run(Scheduler(args, model=model))
    with backend.using(backend.accelerator_on_cpu("reference")):
        sched = Scheduler(args, model=model)
        warm_up(sched)
        built = EXECUTABLES.stats().built
        assert run(sched) == chain
        assert EXECUTABLES.stats().built == built
        assert sched.runner.step_shapes(shapes_of(sched)) == [
            (8, 8), (16, 16), (64, 8), (64, 16), (256, 8), (256, 16)]
        assert {("step", 64, 8), ("step", 64, 16)} <= sched.forward_shapes


def test_an_overlapped_step_drops_what_it_computed_for_a_finished_request() -> None:
    """With steps overlapped, a request aborted (or finished) while its step is in flight gets
    no token from it, its pages go back once, and the others run on unchanged."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=32, page_size=PAGE, max_running=4,
                         context_length=128)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with backend.using(backend.accelerator_on_cpu("reference")):
        alone = Scheduler(args, model=model)
        alone.add_request(alone.make_request("b", "second prompt", greedy))
        want = [t for o in alone.run_until_idle() for t in o.new_token_ids]
        sched = Scheduler(args, model=model)
        for rid, prompt in (("a", "first prompt"), ("b", "second prompt")):
            sched.add_request(sched.make_request(rid, prompt, greedy))
        got: dict[str, list[int]] = {"a": [], "b": []}
        for _ in range(4):
            for o in sched.step():
                got[o.rid].extend(o.new_token_ids)
        assert sched._inflight is not None  # a decode step is on its way
        sched.abort("a")
        for o in sched.run_until_idle():
            got[o.rid].extend(o.new_token_ids)
        assert got["b"] == want
        assert len(got["a"]) < 8
        stats = sched.stats()
        assert stats.free_pages + stats.cached_pages == stats.total_pages


def test_overlapped_first_tokens_leave_once_the_decode_step_is_launched() -> None:
    """With steps overlapped, ``step(early)`` hands a new prompt's first token out after its
    step's decode forward is dispatched (the device runs it meanwhile) and before the step in
    flight is read; the tokens are those of steps run without ``early``."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=32, page_size=PAGE, max_running=4,
                         context_length=128)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with backend.using(backend.accelerator_on_cpu("reference")):
        runs: dict[bool, dict[str, list[int]]] = {}
        for use_early in (False, True):
            sched = Scheduler(args, model=model)
            got: dict[str, list[int]] = {"a": [], "b": []}
            seen: list[tuple[str, bool, int]] = []

            def early(outs: list[RequestOutput], sched: Scheduler = sched,
                      got: dict[str, list[int]] = got, seen: list[tuple[str, bool, int]] = seen
                      ) -> None:
                for o in outs:
                    seen.append((o.rid, sched._inflight is not None,
                                 len(sched.reqs["a"].output_ids)))
                    got[o.rid].extend(o.new_token_ids)

            sched.add_request(sched.make_request("a", "first prompt", greedy))
            for _ in range(3):
                for o in sched.step(early if use_early else None):
                    got[o.rid].extend(o.new_token_ids)
            a_before = len(sched.reqs["a"].output_ids)
            sched.add_request(sched.make_request("b", "second prompt", greedy))
            for o in sched.step(early if use_early else None):
                got[o.rid].extend(o.new_token_ids)
            if use_early:
                # "b"'s first token left with the decode step launched and "a"'s step in flight
                # not yet read.
                assert ("b", True, a_before) in seen
            for o in sched.run_until_idle():
                got[o.rid].extend(o.new_token_ids)
            runs[use_early] = got
        assert runs[True] == runs[False]
        assert all(len(tokens) == 6 for tokens in runs[True].values())


def test_nothing_compiles_after_the_warm_up_and_a_step_sends_one_host_array(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the warm-up, requests of new lengths (prefill and decode steps of every shape they
    take, greedy, sampled and penalized rows) compile nothing: no step, no seeding of a
    penalty's counts, and no small program of JAX's own (``jnp.asarray`` of a host array
    compiles one per new shape; the runner never makes one). Each step hands its executable
    one host array, every row's sampling packed with the rest (its one host-to-device transfer,
    made by the call); the bitmask is the one kept on the device but while a ban lasts (a
    second host array), and nothing else is uploaded apart."""
    model = _model()
    uploads: list[object] = []

    def counted(host: Any) -> jax.Array:
        uploads.append(host)
        return upload(host)

    monkeypatch.setattr(model_runner, "upload", counted)
    args = SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=8,
                         max_batched_tokens=128, context_length=256)
    compiles: list[str] = []

    def listen(event: str, seconds: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    with backend.using(backend.accelerator_on_cpu("reference")):
        sched = Scheduler(args, model=model)
        warm_up(sched)
        sent: list[tuple[object, object]] = []  # each step's (batch, bitmask)
        run_step = sched.runner.run_step

        def count_step(tokens: int, seqs: int, batch: Any, bitmask: Any
                       ) -> tuple[tuple[jax.Array, ...], jax.Array]:
            sent.append((batch, bitmask))
            return run_step(tokens, seqs, batch, bitmask)

        monkeypatch.setattr(sched.runner, "run_step", count_step)
        uploads.clear()
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            for i, n in enumerate((5, 37, 100)):
                for j, sampling in enumerate((
                        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                        SamplingParams(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=i,
                                       ignore_eos=True),
                        SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True,
                                       frequency_penalty=0.5, min_new_tokens=2))):
                    sched.add_request(Req(f"r{i}{j}", list(range(1, n + 1)), sampling))
                sched.run_until_idle()
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    assert sent and all(isinstance(batch, np.ndarray) and batch.ndim == 1 for batch, _ in sent)
    # Host bitmasks: the penalized requests' first two tokens banned from ending them.
    bans = [m for _, m in sent if isinstance(m, np.ndarray)]
    assert 0 < len(bans) <= 2 * 3 and all(isinstance(m, jax.Array) for _, m in sent
                                          if not isinstance(m, np.ndarray))
    assert uploads == []  # nothing sent apart by the runner (a slot's seeding: penalty_slots.py)


@pytest.mark.parametrize("attention", ["reference", "interpret"])
def test_the_warm_up_runs_each_step_once_and_writes_only_the_null_page(
    attention: backend.Attention,
) -> None:
    """``warm_up`` runs every fused step shape once on padding (a first run's cost paid before
    ready): each shape's executable is then held by the runner, the pool's pages but the null
    page are as they were (a request's KV among them), and the tokens after it are the same;
    with the kernel too (every sequence of those steps empty)."""
    model = _model()
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=PAGE, max_running=4,
                         max_batched_tokens=64, context_length=128)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)

    def pages(sched: Scheduler) -> list[np.ndarray]:
        with sched.runner.kv_holder.locked() as pools:
            return [np.asarray(a)[1:].copy() for a in pools[MAIN_KV]]

    with backend.using(backend.accelerator_on_cpu(attention)):
        sched = Scheduler(args, model=model)
        sched.add_request(sched.make_request("a", "a prompt of some length", greedy))
        first = [t for o in sched.run_until_idle() for t in o.new_token_ids]
        before = pages(sched)
        report = warm_up(sched)
        after = pages(sched)
        shapes = {(t, n, "sample") for t, n in sched.runner.step_shapes(report.shapes)}
        assert shapes and shapes <= set(sched.runner._steps)
        assert all(np.array_equal(b, a) for b, a in zip(before, after, strict=True))
        sched.add_request(sched.make_request("b", "a prompt of some length", greedy))
        again = [t for o in sched.run_until_idle() for t in o.new_token_ids]
    assert again == first


def test_tensor_parallel_instances_keep_the_chain() -> None:
    accel = backend.accelerator_on_cpu()
    assert accel.for_tp(1).fused_step and accel.for_tp(1).kv_lanes
    assert not accel.for_tp(2).fused_step and not accel.for_tp(2).kv_lanes

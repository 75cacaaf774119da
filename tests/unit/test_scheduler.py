"""The colocated scheduler on the tiny random-weight model."""

from __future__ import annotations

import time
from collections import defaultdict

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.backend import for_platform
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import (
    MAIN_KV,
    FinishReason,
    Req,
    RequestOutput,
    Scheduler,
    SchedulerArgs,
    make_scheduler,
)
from pd_fsm.schedulers.args import prefill_budget
from pd_fsm.schedulers.role import ColocatedRole
from pd_fsm.schedulers.warm_up import shapes_of, warm_up
from pd_fsm.text.tokenizer import CharTokenizer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _args(**kw: object) -> SchedulerArgs:
    base: dict[str, object] = {
        "model": "tiny",
        "num_pages": 128,
        "page_size": 4,
        "max_running": 8,
        "max_batched_tokens": 256,
    }
    base.update(kw)
    return SchedulerArgs(**base)  # type: ignore[arg-type]


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, size=n).tolist()


def _collect(outputs: list[RequestOutput]) -> dict[str, dict[str, object]]:
    acc: dict[str, dict[str, object]] = defaultdict(lambda: {"ids": [], "text": "", "lps": []})
    for o in outputs:
        acc[o.rid]["ids"] += list(o.new_token_ids)  # type: ignore[operator]
        acc[o.rid]["lps"] += list(o.new_logprobs)  # type: ignore[operator]
        acc[o.rid]["text"] += o.text_delta  # type: ignore[operator]
        if o.finished:
            acc[o.rid]["reason"] = o.finish_reason
    return dict(acc)


def _run(sched: Scheduler, reqs: list[Req]) -> dict[str, dict[str, object]]:
    for r in reqs:
        sched.add_request(r)
    out = _collect(sched.run_until_idle())
    s = sched.stats()
    assert s.free_pages == s.total_pages
    return out


LENGTHS = [3, 9, 17, 30, 5]


@pytest.mark.parametrize("max_batched_tokens", [256, 16])
def test_batched_equals_each_alone(tiny: LoadedModel, max_batched_tokens: int) -> None:
    """Continuous batching (and chunked prefill, at 16 tokens a forward) changes no token."""
    alone = {}
    for i, n in enumerate(LENGTHS):
        sched = Scheduler(_args(), model=tiny)
        alone[f"r{i}"] = _run(sched, [Req(f"r{i}", _prompt(i, n), GREEDY)])[f"r{i}"]
    sched = Scheduler(_args(max_batched_tokens=max_batched_tokens, max_running=3), model=tiny)
    together = _run(sched, [Req(f"r{i}", _prompt(i, n), GREEDY) for i, n in enumerate(LENGTHS)])
    for rid, got in together.items():
        assert got["ids"] == alone[rid]["ids"], rid
        assert got["reason"] == FinishReason("length")
        np.testing.assert_allclose(got["lps"], alone[rid]["lps"], atol=1e-4)
    assert len(alone["r0"]["ids"]) == GREEDY.max_new_tokens  # type: ignore[arg-type]


def test_admission_waits_for_pages_and_proceeds_when_freed(tiny: LoadedModel) -> None:
    # Each request needs ceil((8 + 12) / 4) = 5 pages; 10 usable pages admit two at a time.
    sched = Scheduler(_args(num_pages=11), model=tiny)
    for i in range(3):
        sched.add_request(Req(f"r{i}", _prompt(i, 8), GREEDY))
    sched.step()
    s = sched.stats()
    assert (s.waiting, s.running, s.free_pages) == (1, 2, 0)
    outputs = sched.step()
    while not any(o.finished for o in outputs):
        s = sched.stats()
        assert (s.waiting, s.free_pages) == (1, 0)  # r2 waits while r0 and r1 hold every page
        outputs = sched.step()
    assert {o.rid for o in outputs if o.finished} == {"r0", "r1"}
    assert sched.stats().free_pages == 10
    outputs += sched.step()
    s = sched.stats()
    assert (s.waiting, s.running, s.free_pages) == (0, 1, 5)
    done = _collect(outputs + sched.run_until_idle())
    assert done["r2"]["reason"] == FinishReason("length")
    assert sched.stats().free_pages == sched.stats().total_pages == 10


def test_abort_frees_pages_exactly_once(tiny: LoadedModel) -> None:
    sched = Scheduler(_args(num_pages=11), model=tiny)
    for i in range(3):
        sched.add_request(Req(f"r{i}", _prompt(i, 8), GREEDY))
    sched.step()
    assert sched.stats().free_pages == 0
    assert sched.abort("r0", "client went away")  # running
    assert sched.abort("r2")  # still waiting, holds no pages
    assert not sched.abort("r2")  # already finished
    assert not sched.abort("nope")
    assert sched.stats().free_pages == 5
    outs = _collect(sched.run_until_idle())
    assert outs["r0"]["reason"] == FinishReason("abort", message="client went away")
    assert outs["r2"]["reason"] == FinishReason("abort", message="aborted")
    assert outs["r1"]["reason"] == FinishReason("length")
    s = sched.stats()
    assert s.free_pages == s.total_pages and (s.waiting, s.prefilling, s.running) == (0, 0, 0)


def test_max_new_tokens_eos_and_stop_token_ids(tiny: LoadedModel) -> None:
    prompt = _prompt(7, 6)
    ref = _run(Scheduler(_args(), model=tiny), [Req("a", prompt, GREEDY)])["a"]
    ids: list[int] = ref["ids"]  # type: ignore[assignment]
    eos = ids[4]
    first = ids.index(eos)
    eos_model = attrs.evolve(tiny, tokenizer=CharTokenizer(256, eos_token_id=eos))
    sp = attrs.evolve(GREEDY, ignore_eos=False)
    got = _run(Scheduler(_args(), model=eos_model), [Req("a", prompt, sp)])["a"]
    assert got["ids"] == ids[: first + 1]
    assert got["reason"] == FinishReason("stop", matched=eos)
    assert got["text"] == "".join(map(chr, ids[:first]))  # the EOS itself adds no text
    # ignore_eos runs on to max_new_tokens; stop_token_ids stop on any model.
    got = _run(Scheduler(_args(), model=eos_model), [Req("a", prompt, GREEDY)])["a"]
    assert got["ids"] == ids
    sp = attrs.evolve(GREEDY, stop_token_ids=(eos,))
    got = _run(Scheduler(_args(), model=tiny), [Req("a", prompt, sp)])["a"]
    assert got["ids"] == ids[: first + 1]
    sp = attrs.evolve(GREEDY, max_new_tokens=3)
    got = _run(Scheduler(_args(), model=tiny), [Req("a", prompt, sp)])["a"]
    assert got["ids"] == ids[:3] and got["reason"] == FinishReason("length")


def test_stop_strings_trim_text_and_never_stream_the_stop(tiny: LoadedModel) -> None:
    prompt = _prompt(8, 6)
    ref = _run(Scheduler(_args(), model=tiny), [Req("a", prompt, GREEDY)])["a"]
    text: str = ref["text"]  # type: ignore[assignment]
    assert text == "".join(map(chr, ref["ids"]))  # type: ignore[arg-type]
    stop = text[5:8]
    cut = text.find(stop)
    sp = attrs.evolve(GREEDY, stop=("\x00never", stop))
    sched = Scheduler(_args(), model=tiny)
    sched.add_request(Req("a", prompt, sp))
    streamed = ""
    outputs = sched.run_until_idle()
    for o in outputs:
        streamed += o.text_delta
        assert stop not in streamed
    got = _collect(outputs)["a"]
    assert got["text"] == streamed == text[:cut]
    assert got["reason"] == FinishReason("stop", matched=stop)
    assert got["ids"] == ref["ids"][: cut + len(stop)]  # type: ignore[index]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny: LoadedModel) -> None:
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, max_new_tokens=10)
    prompt = _prompt(9, 5)
    alone = _run(Scheduler(_args(), model=tiny), [Req("s", prompt, sp)])["s"]["ids"]
    others = [Req(f"o{i}", _prompt(20 + i, 4 + i), GREEDY) for i in range(3)]
    batched = _run(Scheduler(_args(), model=tiny), [*others, Req("s", prompt, sp)])["s"]["ids"]
    assert batched == alone
    other_seed = attrs.evolve(sp, seed=43)
    assert _run(Scheduler(_args(), model=tiny), [Req("s", prompt, other_seed)])["s"]["ids"] != alone
    # Without a request seed, the scheduler's random_seed makes a whole run reproducible.
    unseeded = attrs.evolve(sp, seed=None)
    runs = [
        _run(Scheduler(_args(random_seed=5), model=tiny), [Req("s", prompt, unseeded)])["s"]["ids"]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_warm_up_compiles_every_shape_later_requests_use(tiny: LoadedModel) -> None:
    """After ``warm_up`` nothing compiles: prompts of every length (some chunked: longer than the
    token budget), batches of every size, greedy and sampled."""
    rng = np.random.default_rng(0)
    sched = Scheduler(_args(max_running=4, max_batched_tokens=64, page_size=8), model=tiny)
    report = warm_up(sched)
    assert set(report.shapes) == set(shapes_of(sched))
    assert warm_up(sched).executables == 0  # idempotent
    before = EXECUTABLES.stats().compiles
    for i in range(40):
        sp = attrs.evolve(
            GREEDY,
            max_new_tokens=int(rng.integers(1, 10)),
            temperature=float(rng.choice([0.0, 0.8])),
        )
        sched.add_request(Req(f"r{i}", _prompt(i, int(rng.integers(1, 100))), sp))
    outs = _collect(sched.run_until_idle())
    assert len(outs) == 40 and all(o["reason"].kind == "length" for o in outs.values())
    assert EXECUTABLES.stats().compiles == before
    used = {(s[1], s[2]) if s[0] == "extend" else (s[1], 1) for s in sched.forward_shapes}
    assert used <= set(report.shapes)
    assert any(t > 1 and n > 1 for n, t in used)  # batched prefills happened
    assert any(t == 1 and n > 1 for n, t in used)  # and batched decodes


def test_prefilled_request_enters_decode_without_prefill_forward(tiny: LoadedModel) -> None:
    """The PD path: one scheduler prefills and keeps the pages, another gets the KV copied into
    its own pages plus the first token, and decodes the same tokens as a colocated run."""
    prompt = _prompt(11, 13)
    ref = _run(Scheduler(_args(), model=tiny), [Req("a", prompt, GREEDY)])["a"]

    class PrefillOnly(ColocatedRole):
        """A role that keeps each prefilled request (and its pages) instead of decoding it."""

        def __init__(self, sched: Scheduler) -> None:
            self.sched = sched
            self.handed_off: list[tuple[Req, int, float]] = []

        def take_prefilled(
            self, req: Req, first_token: int, first_logprob: float, first_top: object
        ) -> bool:
            self.sched.prefilling.remove(req)
            self.handed_off.append((req, first_token, first_logprob))
            return True

    p = Scheduler(_args(), model=tiny, role=PrefillOnly)
    assert isinstance(p.role, PrefillOnly)
    p.add_request(Req("a", prompt, GREEDY))
    p.step()
    (src, tok, lp), = p.role.handed_off
    assert src.pages is not None

    d = Scheduler(_args(num_pages=64), model=tiny)
    dst = Req("a", prompt, GREEDY)
    d.register(dst)
    assert d.page_budget.reserve(dst) and dst.pages is not None
    n = d.pool_config.pages_for(len(prompt))
    with p.kv_holder.locked() as src_pools:
        src_kv = src_pools[MAIN_KV]
        d.runner.with_kv(
            lambda kv: (
                None,
                [
                    dl.at[jnp.asarray(dst.pages[:n])].set(sl[jnp.asarray(src.pages[:n])])  # type: ignore[index]
                    for dl, sl in zip(kv, src_kv, strict=True)
                ],
            )
        )
    d.add_prefilled_request(dst, tok, lp)
    got = _collect(d.run_until_idle())["a"]
    assert not any(s[0] == "extend" for s in d.forward_shapes)
    assert got["ids"] == ref["ids"]
    np.testing.assert_allclose(got["lps"], ref["lps"], atol=1e-4)
    assert d.stats().free_pages == d.stats().total_pages


def test_rejects_requests_that_can_never_run(tiny: LoadedModel) -> None:
    sched = Scheduler(_args(num_pages=5, context_length=64), model=tiny)
    with pytest.raises(ValueError, match="pages"):
        sched.add_request(Req("big", _prompt(0, 10), attrs.evolve(GREEDY, max_new_tokens=20)))
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(Req("long", _prompt(0, 64), GREEDY))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Req("e", [], GREEDY))
    sched.add_request(Req("ok", _prompt(0, 3), attrs.evolve(GREEDY, max_new_tokens=2)))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Req("ok", _prompt(0, 3), GREEDY))
    assert sched.stats().total_pages == sched.stats().free_pages == 4


def test_make_scheduler_modes(tiny: LoadedModel) -> None:
    assert type(make_scheduler(_args(), model=tiny)) is Scheduler
    with pytest.raises(ValueError):
        _args(disaggregation_mode="both")


def test_submit_and_request_abort_apply_at_the_next_step(tiny: LoadedModel) -> None:
    """The thread-safe entry points: queued, applied by step(), rejections reported as output."""
    sched = Scheduler(_args(num_pages=11), model=tiny)
    sched.submit(Req("a", _prompt(1, 8), GREEDY))
    sched.submit(Req("a", _prompt(2, 8), GREEDY))  # duplicate id
    sched.submit(Req("huge", _prompt(3, 8), attrs.evolve(GREEDY, max_new_tokens=100)))
    assert sched.stats().waiting == 0 and sched.has_work()
    first = sched.step()
    rejected = [o for o in first if o.finished]
    assert [o.rid for o in rejected] == ["a", "huge"]
    assert rejected[0].finish_reason is not None and "duplicate" in str(
        rejected[0].finish_reason.message
    )
    assert sched.stats().running == 1
    sched.request_abort("a", "bye")
    outs = _collect(sched.run_until_idle())
    assert outs["a"]["reason"] == FinishReason("abort", message="bye")
    assert sched.stats().free_pages == sched.stats().total_pages


def test_first_token_goes_out_before_the_steps_decode_forward(tiny: LoadedModel) -> None:
    """``step(early)``: a prompt's first token leaves before the decode forward of its own step
    (the one that makes its second token and the running requests' next ones), and the outputs
    are the same tokens as without ``early``, only sooner."""
    late, soon = Scheduler(_args(), model=tiny), Scheduler(_args(), model=tiny)
    calls: list[tuple[list[RequestOutput], int]] = []

    def early(outs: list[RequestOutput]) -> None:
        # How many tokens "a" had when the early outputs left: its next one is not made yet.
        calls.append((outs, len(soon.reqs["a"].output_ids)))

    got: list[RequestOutput] = []
    want: list[RequestOutput] = []
    for sched in (late, soon):
        sched.add_request(Req("a", _prompt(1, 8), GREEDY))
    got += soon.step(early)  # "a" alone: its first token early, its second in the result
    want += late.step()
    first, tokens_then = calls[0]
    assert [(o.rid, o.new_token_ids) for o in first] == [("a", (soon.reqs["a"].output_ids[0],))]
    assert tokens_then == 1 and [o.rid for o in got] == ["a"]
    for sched in (late, soon):
        sched.add_request(Req("b", _prompt(2, 8), GREEDY))
    got += soon.step(early)  # "b" prefills while "a" decodes
    want += late.step()
    assert [o.rid for o in calls[1][0]] == ["b"] and len(calls[1][0][0].new_token_ids) == 1
    assert calls[1][1] == 2  # "a" still at two tokens: the decode forward had not run
    while late.has_work():
        want += late.step()
    while soon.has_work():
        got += soon.step(early)
    early_outs = [o for outs, _ in calls for o in outs]
    assert _collect(early_outs + got) == _collect(want)
    # Every step after the first two had no new prompt: nothing else went early.
    assert len(calls) == 2


def test_no_early_outputs_without_a_decode_forward(tiny: LoadedModel) -> None:
    """A step with no decode forward to wait for returns its outputs as before."""
    sched = Scheduler(_args(), model=tiny)
    one = attrs.evolve(GREEDY, max_new_tokens=1)  # finished by its prefill: nothing to decode
    sched.add_request(Req("a", _prompt(1, 8), one))
    calls: list[list[RequestOutput]] = []
    outs = sched.step(calls.append)
    assert calls == [] and [o.rid for o in outs] == ["a"] and outs[0].finished


def test_the_prefill_budget_defaults_by_backend_and_a_given_one_stays(tiny: LoadedModel) -> None:
    # Not given: the backend's (256 on CPU, where a forward's cost grows much faster than its
    # tokens); every reader of the arguments sees the resolved value.
    sched = Scheduler(_args(max_batched_tokens=None), model=tiny)
    expected = prefill_budget(None)
    assert sched.max_batched_tokens == sched.args.max_batched_tokens == expected
    if jax.default_backend() == "cpu":
        assert expected == 256
    assert for_platform("gpu").prefill_tokens == 1024 and prefill_budget(64) == 64
    assert Scheduler(_args(max_batched_tokens=64), model=tiny).max_batched_tokens == 64
    # A 300-token prompt on CPU is two forwards (256 + 44), not one padded to 512.
    sched.add_request(Req("long", _prompt(3, 300), SamplingParams(max_new_tokens=1)))
    sched.run_until_idle()
    prefills = [shape[1:] for shape in sched.forward_shapes if shape[0].startswith("extend")]
    assert prefills and max(n * t for n, t in prefills) <= expected


def test_the_first_output_says_when_its_prefill_ran(tiny: LoadedModel) -> None:
    """A prompt prefilled here (in chunks of 16 tokens) carries, in the output with its first
    token and in no other, when its first chunk ran and when that token reached the host; a
    request whose first token came from elsewhere (PD's decode side) carries none."""
    sched = Scheduler(_args(max_batched_tokens=16), model=tiny)
    before = time.monotonic()
    sched.add_request(Req("a", _prompt(3, 40), GREEDY))
    outputs = sched.run_until_idle()
    timed = [o for o in outputs if o.first_token_times is not None]
    assert len(timed) == 1 and timed[0] is next(o for o in outputs if o.new_token_ids)
    began, first = timed[0].first_token_times  # type: ignore[misc]
    assert before <= began < first <= time.monotonic()
    d = Scheduler(_args(), model=tiny)
    dst = Req("b", _prompt(4, 8), GREEDY)
    d.register(dst)
    assert d.page_budget.reserve(dst)
    d.add_prefilled_request(dst, 5, -0.5)
    assert all(o.first_token_times is None for o in d.run_until_idle())

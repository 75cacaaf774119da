"""Structured output in the scheduler (tiny model, random weights: only the grammar keeps its
text in shape): every output matches its constraint, sampled or greedy, forked or not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.grammar import Constraint, GrammarError, compiler_for
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, RequestOutput, Scheduler, SchedulerArgs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green"]}}}
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _texts(tiny: LoadedModel, reqs: list[Req], fused: bool = False
           ) -> dict[tuple[str, int], str]:
    """Each output's text; ``fused``: every step ran as the fused step program."""
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                         max_batched_tokens=256)
    sched = Scheduler(args, model=tiny)
    for req in reqs:
        sched.add_request(req)
    outputs: list[RequestOutput] = sched.run_until_idle()
    assert fused == all(shape[0] == "step" for shape in sched.forward_shapes)
    stats = sched.stats()
    assert stats.free_pages == stats.total_pages
    texts: dict[tuple[str, int], str] = {}
    for o in outputs:
        texts[o.rid, o.index] = texts.get((o.rid, o.index), "") + o.text_delta
        if o.finish_reason is not None:
            assert o.finish_reason.kind == "stop", (o.rid, o.finish_reason)
    return texts


def _requests(constraints: dict[str, Constraint], temperature: float, n: int) -> list[Req]:
    return [Req(name, PROMPT, SamplingParams(temperature=temperature, max_new_tokens=60,
                                             seed=7, n=n, constraint=c))
            for name, c in constraints.items()]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_matches_its_constraint(tiny: LoadedModel, temperature: float) -> None:
    constraints = {
        "regex": Constraint("regex", "[a-c]{2,4}x"),
        "json": Constraint("json_schema", json.dumps(SCHEMA)),
        "ebnf": Constraint("ebnf", 'root ::= "yes" | "no" | "maybe"'),
    }
    texts = _texts(tiny, _requests(constraints, temperature, n=3))
    assert len(texts) == 9
    for (name, _), text in texts.items():
        if name == "regex":
            assert re.fullmatch("[a-c]{2,4}x", text), text
        elif name == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert text in ("yes", "no", "maybe")


def test_a_grammar_the_engine_refuses_is_named(tiny: LoadedModel) -> None:
    compiler = compiler_for(tiny.tokenizer, tiny.config.vocab_size)
    with pytest.raises(GrammarError, match="unclosed character class"):
        compiler.check(Constraint("regex", "[a-"))
    with pytest.raises(GrammarError, match="json_schema"):
        compiler.check(Constraint("json_schema", '{"type": "nonsense"}'))
    sched = Scheduler(SchedulerArgs(model="tiny", num_pages=16, page_size=4), model=tiny)
    with pytest.raises(ValueError, match="regex"):
        sched.add_request(Req("bad", PROMPT, SamplingParams(max_new_tokens=8,
                                                            constraint=Constraint("regex", "("))))


def test_the_accelerators_fused_step_keeps_a_grammar_as_the_chain_does(
        tiny: LoadedModel) -> None:
    """A constrained row on the accelerator's fused step (attention by the XLA reference, on
    the CPU) takes its grammar's bitmask as the step's one array beside the packed rows, a
    sampled and a greedy row sharing a step: the same text as the chain's."""
    constraints = {"regex": Constraint("regex", "[a-c]{2,4}x"),
                   "ebnf": Constraint("ebnf", 'root ::= "yes" | "no" | "maybe"')}
    reqs = [*_requests(constraints, 1.0, n=1),
            Req("greedy", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=20,
                                                 constraint=constraints["regex"]))]
    chain = _texts(tiny, reqs)
    with backend.using(backend.accelerator_on_cpu("reference")):
        fused = _texts(tiny, [Req(r.rid, r.input_ids, r.sampling) for r in reqs], fused=True)
    assert fused == chain
    assert re.fullmatch("[a-c]{2,4}x", chain["regex", 0]), chain

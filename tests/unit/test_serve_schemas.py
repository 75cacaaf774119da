"""Every request field is read, accepted only at a value that asks for nothing, or refused by
name (``schemas._TOP_LEVEL``): what sglang-router 0.3.2 re-serialises parses; what a client asks
and the worker does not implement is a 400 naming the field, never a 200 that ignored it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_fsm.io_trio.worker.backend import BootstrapInfo
from pd_fsm.io_trio.worker.schemas import (
    ApiError,
    Limits,
    parse_chat,
    parse_completion,
    parse_generate,
    single_bootstrap,
    split_batch,
)
from pd_fsm.jax_engine.sampling.grammar import Constraint
from pd_fsm.schedulers.request import LogprobSpec

LIMITS = Limits(context_length=256, vocab_size=1000)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 3}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
BOOT = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5}

# The bodies sglang-router 0.3.2 sent a stand-in P in PD mode (recorded from the real router;
# tests/integration/test_serve_sglang_router.py checks it still sends what parses).
ROUTER_CHAT = {**BOOT, "continue_final_message": False, "ignore_eos": False, "logprobs": False,
               "max_completion_tokens": 3, "messages": [{"content": "hi", "role": "user"}],
               "model": "m", "no_stop_trim": False, "return_hidden_states": False,
               "separate_reasoning": True, "skip_special_tokens": True, "stream": False,
               "stream_reasoning": True}
ROUTER_COMPLETION = {**BOOT, "echo": False, "ignore_eos": False, "max_tokens": 3, "model": "m",
                     "no_stop_trim": False, "prompt": "hi", "return_hidden_states": False,
                     "skip_special_tokens": True, "stream": False}
ROUTER_GENERATE = {**BOOT, "background": False, "log_metrics": True, "model": None,
                   "no_logs": False, "return_bytes": False, "return_entropy": False,
                   "return_hidden_states": False, "return_text_in_logprobs": False,
                   "sampling_params": {"max_new_tokens": 2}, "stream": False, "text": "hi"}


def test_logprobs_of_the_sampled_tokens_are_read() -> None:
    assert parse_chat({**CHAT, "logprobs": True}, LIMITS).return_logprob
    assert parse_chat({**CHAT, "logprobs": True, "top_logprobs": 0}, LIMITS).return_logprob
    assert not parse_chat({**CHAT, "logprobs": False}, LIMITS).return_logprob
    assert parse_completion({**COMPLETION, "logprobs": 0}, LIMITS).return_logprob
    assert not parse_completion(COMPLETION, LIMITS).return_logprob


def test_top_alternatives_and_prompt_logprobs_are_read() -> None:
    chat = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 3}, LIMITS)
    assert chat.logprobs == LogprobSpec(top=3)
    echo = parse_completion({**COMPLETION, "logprobs": 2, "echo": True}, LIMITS)
    assert echo.echo and echo.return_logprob and echo.logprobs == LogprobSpec(2, prompt_from=0)
    plain_echo = parse_completion({**COMPLETION, "echo": True}, LIMITS)
    assert plain_echo.echo and not plain_echo.return_logprob
    gen = parse_generate({**GENERATE, "return_logprob": True, "top_logprobs_num": 4,
                          "logprob_start_len": 1, "return_text_in_logprobs": True}, LIMITS)
    assert gen.logprobs == LogprobSpec(top=4, prompt_from=1) and gen.return_text_in_logprobs
    # Without return_logprob, sglang's other two fields ask for nothing.
    quiet = parse_generate({**GENERATE, "top_logprobs_num": 4, "logprob_start_len": 0}, LIMITS)
    assert not quiet.return_logprob and quiet.logprobs == LogprobSpec()


def test_penalties_and_min_tokens_are_read() -> None:
    sp = parse_chat({**CHAT, "frequency_penalty": 0.5, "presence_penalty": -0.5,
                     "repetition_penalty": 1.2, "min_tokens": 2}, LIMITS).sampling
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty,
            sp.min_new_tokens) == (0.5, -0.5, 1.2, 2)
    sp = parse_generate({"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 4, "repetition_penalty": 1.1}}, LIMITS).sampling
    assert sp.min_new_tokens == 4 and sp.repetition_penalty == 1.1 and sp.penalized
    assert not parse_chat(CHAT, LIMITS).sampling.penalized


def test_what_sglang_router_sends_parses() -> None:
    assert parse_chat(ROUTER_CHAT, LIMITS).sampling.max_new_tokens == 3
    assert parse_completion(ROUTER_COMPLETION, LIMITS).text == "hi"
    assert parse_generate(ROUTER_GENERATE, LIMITS).bootstrap is not None


@pytest.mark.parametrize("extra", [
    {"tools": []}, {"tools": None}, {"response_format": {"type": "text"}}, {"logit_bias": {}},
    {"n": 1}, {"tool_choice": "none"}, {"user": "alice"}, {"metadata": {"k": "v"}},
    {"frequency_penalty": 0}, {"presence_penalty": 0.0}, {"logprobs": False},
    {"top_logprobs": 0}, {"parallel_tool_calls": True},
])
def test_a_field_at_the_value_that_asks_for_nothing_is_accepted(extra: dict[str, Any]) -> None:
    parse_chat({**CHAT, **extra}, LIMITS)


@pytest.mark.parametrize(("parse", "base", "extra", "named"), [
    (parse_chat, CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    (parse_chat, CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (parse_chat, CHAT, {"tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools[0].function.name"),
    (parse_chat, CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": {"type": "function", "function": {"name": "h"}}},
     "tool_choice"),
    (parse_chat, CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                        "response_format": {"type": "json_object"}}, "tools"),
    (parse_completion, COMPLETION, {"tools": [{"type": "function"}]}, "tools"),
    (parse_chat, CHAT, {"tool_choice": "required"}, "tool_choice"),
    (parse_chat, CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (parse_chat, CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (parse_chat, CHAT, {"logprobs": 1}, "logprobs"),  # a bool, not a number
    (parse_chat, CHAT, {"n": 17}, "n"),
    (parse_completion, COMPLETION, {"n": 2, "best_of": 1}, "best_of"),
    (parse_generate, GENERATE, {"sampling_params": {"n": 0}}, "sampling_params.n"),
    (parse_chat, CHAT, {"n": True}, "n"),
    (parse_chat, CHAT, {"logit_bias": {"5": 10}}, "logit_bias"),
    (parse_chat, CHAT, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (parse_chat, CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (parse_chat, CHAT, {"min_tokens": 4}, "min_tokens"),  # more than max_tokens=3
    (parse_generate, GENERATE, {"sampling_params": {"min_new_tokens": -1}},
     "sampling_params.min_new_tokens"),
    (parse_chat, CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
    (parse_chat, CHAT, {"return_hidden_states": True}, "return_hidden_states"),
    (parse_completion, COMPLETION, {"echo": 1}, "echo"),
    (parse_completion, COMPLETION, {"suffix": "end"}, "suffix"),
    (parse_completion, COMPLETION, {"best_of": 17}, "best_of"),
    (parse_completion, COMPLETION, {"logprobs": 21}, "logprobs"),  # OpenAI's maximum is 20
    (parse_completion, COMPLETION, {"logprobs": True}, "logprobs"),  # a number, not a bool
    (parse_completion, COMPLETION, {"max_token": 5}, "max_token"),  # a typo is no default
    (parse_generate, GENERATE, {"logprob_start_len": -2}, "logprob_start_len"),
    (parse_generate, GENERATE, {"top_logprobs_num": 21}, "top_logprobs_num"),
    (parse_generate, GENERATE, {"top_logprobs_num": "3"}, "top_logprobs_num"),
    (parse_generate, GENERATE, {"image_data": "x.png"}, "image_data"),
    (parse_generate, GENERATE, {"lora_path": "adapter"}, "lora_path"),
    (parse_generate, GENERATE, {"sampling_params": {"regex": 5}}, "sampling_params.regex"),
    (parse_generate, GENERATE, {"sampling_params": {"json_schema": "{"}},
     "sampling_params.json_schema"),
    (parse_generate, GENERATE, {"sampling_params": {"max_new_token": 5}},
     "sampling_params.max_new_token"),
])
def test_an_unimplemented_field_is_refused_by_name(
    parse: Any, base: dict[str, Any], extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(ApiError) as err:
        parse({**base, **extra}, LIMITS)
    assert err.value.status == 400
    prefixes = (f"{named}=", f"{named} must", f"{named}.", f"unknown field {named} ")
    assert err.value.message.startswith(prefixes), err.value.message


def test_n_and_best_of_are_read() -> None:
    chat = parse_chat({**CHAT, "n": 3}, LIMITS)
    assert chat.sampling.n == chat.n == 3
    best = parse_completion({**COMPLETION, "n": 2, "best_of": 4}, LIMITS)
    assert best.sampling.n == 4 and best.n == 2
    gen = parse_generate({**GENERATE, "sampling_params": {"n": 2}}, LIMITS)
    assert gen.sampling.n == gen.n == 2


def test_structured_output_constraints_are_read() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse_chat({**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, LIMITS)
    assert chat.sampling.constraint == Constraint("json_schema", json.dumps(schema))
    obj = parse_chat({**CHAT, "response_format": {"type": "json_object"}}, LIMITS)
    assert obj.sampling.constraint == Constraint("json_schema", '{"type": "object"}')
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}, LIMITS).sampling.constraint \
        is None
    gen = parse_generate({**GENERATE, "sampling_params": {"regex": "[ab]+"}}, LIMITS)
    assert gen.sampling.constraint == Constraint("regex", "[ab]+")
    ebnf = parse_completion({**COMPLETION, "ebnf": 'root ::= "y"'}, LIMITS)
    assert ebnf.sampling.constraint == Constraint("ebnf", 'root ::= "y"')

    with pytest.raises(ApiError, match="at most one of regex"):
        parse_chat({**CHAT, "regex": "a", "response_format": {"type": "json_object"}}, LIMITS)


def test_tools_are_read() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    auto = parse_chat({**CHAT, "tools": [tool]}, LIMITS)
    assert auto.tools is not None and auto.tools.mode == "auto"
    assert auto.sampling.constraint is not None and auto.sampling.constraint.kind == "lark"
    named = parse_chat({**CHAT, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, LIMITS)
    assert named.tools is not None and named.tools.names == ("f",)
    assert parse_chat({**CHAT, "tools": [tool], "tool_choice": "none"}, LIMITS).tools is None
    turn = parse_chat({**CHAT, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}, LIMITS)
    assert turn.messages is not None and turn.messages[2].tool_call_id == "c1"


def test_sglang_router_bootstrap_lists() -> None:
    """A batch gets a room per prompt (its first sequence's); n > 1 one room, the first."""
    lists = {"bootstrap_host": ["h", "h", "h", "h"], "bootstrap_port": [1, 1, 1, 1],
             "bootstrap_room": [10, 11, 12, 13]}
    items = split_batch("completion", {**COMPLETION, "prompt": ["a", "b"], "n": 2, **lists})
    assert items is not None and [i["bootstrap_room"] for i in items] == [10, 12]
    one = single_bootstrap("chat", {**CHAT, "n": 4, **lists})
    assert one["bootstrap_room"] == 10 and one["bootstrap_host"] == "h"
    assert parse_chat(one, LIMITS).bootstrap == BootstrapInfo("h", 1, 10)
    with pytest.raises(ApiError, match="for n=2"):
        single_bootstrap("chat", {**CHAT, "n": 2, **lists})
    with pytest.raises(ApiError, match="one length"):
        single_bootstrap("chat", {**CHAT, **lists, "bootstrap_port": 1})


TICKET = {"transfer_addr": "127.0.0.1:4000", "uuid": 12345, "kv_tokens": 9, "next_token": 7,
          "layout_hash": "abc", "kv_shards": 1, "kv_checksums": []}


def test_a_hand_off_ticket_is_read_with_its_tokens_and_refused_by_name_when_malformed() -> None:
    body = {**GENERATE, "sampling_params": {"max_new_tokens": 20}, "stream": True,
            "resume": {"output_ids": [5, 7], "text": "ab"}, "handoff": TICKET,
            "accept_handoff": True}
    parsed = parse_generate(body, LIMITS)
    # A ticket without lease_s (an older draining worker's) reads as "lease not said".
    assert parsed.handoff is not None and parsed.handoff.to_json() == {**TICKET, "lease_s": 0.0}
    assert parsed.accept_handoff and parsed.resume is not None
    leased = parse_generate({**body, "handoff": {**TICKET, "lease_s": 12.5}}, LIMITS).handoff
    assert leased is not None and leased.lease_s == 12.5
    assert not parse_generate(GENERATE, LIMITS).accept_handoff
    bad: list[tuple[dict[str, Any], str]] = [
        ({k: v for k, v in body.items() if k != "resume"}, "handoff needs resume"),
        ({**body, "handoff": [1]}, "handoff must be an object"),
        ({**body, "handoff": {**TICKET, "uuid": "1"}}, "handoff.uuid must be a int"),
        ({**body, "handoff": {**TICKET, "extra": 1}}, "handoff.extra is not a field"),
        ({**body, "handoff": {**TICKET, "kv_checksums": [-1]}}, "32-bit words"),
        ({**body, "handoff": {**TICKET, "kv_tokens": 0}}, "out of range"),
        *[({**body, "handoff": {**TICKET, "lease_s": v}}, "handoff.lease_s must be seconds")
          for v in (-1, True, "5", 1e9)],
        ({**body, "accept_handoff": 1}, "accept_handoff must be true or false"),
    ]
    for b, why in bad:
        with pytest.raises(ApiError, match=why):
            parse_generate(b, LIMITS)

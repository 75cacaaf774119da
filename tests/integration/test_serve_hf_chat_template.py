"""A Llama-3-style checkpoint answers chat with its own template: a tiny Llama HF checkpoint
whose tokenizer has Llama 3's special tokens and whose ``tokenizer_config.json`` carries Llama 3's
chat template, served by a real ``pd-fsm serve --model DIR``, counts exactly the tokens of the
Llama 3 rendering of a chat (each special token one token); the same checkpoint served with
``--chat-template FILE`` (ChatML) counts those of the ChatML rendering instead."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest

from pd_fsm.io_trio.ports import free_ports
from pd_fsm.jax_engine.model import TINY
from pd_fsm.jax_engine.model.params import random_params_np
from pd_fsm.text.chat_template import CHATML_TEMPLATE
from tests.integration.serve_support import Proc, cli, wait_http_ok
from tests.unit.test_chat_template import LLAMA3
from tests.unit.test_model_hf_loader import _byte_level_tokenizer_json, _export

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
NAME = "tiny-llama3"  # the checkpoint directory's name: what the server is called
SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
SYSTEM, USER = "You are terse.", "Name a mountain range, please."
# Llama 3's rendering of [system, user] with the generation prompt, spelled out by hand.
LLAMA3_PROMPT = (
    f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
    f"<|start_header_id|>user<|end_header_id|>\n\n{USER}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
CHATML_PROMPT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _tokenizer() -> Any:
    """The byte-level BPE of the loader tests plus Llama 3's special tokens (ids 256..259)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_byte_level_tokenizer_json())
    assert tok.add_special_tokens(list(SPECIALS)) == len(SPECIALS)
    return tok


def _write_checkpoint(directory: Path) -> Any:
    tok = _tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)  # 256 bytes + 4 specials
    # The embedding has a row per id the tokenizer can produce (config.json's vocab_size is the
    # model's: a prompt id >= it is refused), so the added tokens need rows too.
    cfg = attrs.evolve(TINY, vocab_size=vocab, max_position=512)
    directory.mkdir()
    _export(directory, random_params_np(cfg, seed=5), "llama", tied=False)
    bos, eot = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>")
    config = json.loads((directory / "config.json").read_text())
    config.update(vocab_size=vocab, bos_token_id=bos, eos_token_id=eot)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3,
    }))
    return tok


@attrs.frozen
class Servers:
    tok: Any
    own: str  # the checkpoint's own template
    chatml: str  # --chat-template chatml.jinja


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("hf_chat")
    checkpoint = root / NAME
    tok = _write_checkpoint(checkpoint)
    template_file = root / "chatml.jinja"
    template_file.write_text(CHATML_TEMPLATE)
    common = ["--model", str(checkpoint), "--host", HOST, "--num-pages", "64",
              "--page-size", "4", "--context-length", "256", "--host-heap", "default"]
    ports = free_ports(2)
    procs: list[Proc] = []
    try:
        # Both start at once: the two model loads / compiles overlap.
        procs.append(Proc.start("own", cli("serve", *common, "--port", str(ports[0]))))
        procs.append(Proc.start("chatml", cli("serve", *common, "--port", str(ports[1]),
                                              "--chat-template", str(template_file))))
        urls = [f"http://{HOST}:{port}" for port in ports]
        for url, proc in zip(urls, procs, strict=True):
            wait_http_ok(f"{url}/health", proc, timeout=240)
        yield Servers(tok, *urls)
    finally:
        for proc in procs:
            proc.stop()


def _chat(url: str) -> Any:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        max_tokens=4,
        temperature=0,
    )


def _count(tok: Any, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_the_expected_renderings_tokenize_as_meant(servers: Servers) -> None:
    """The reference counts themselves: Llama 3's special tokens are one token each (the rest is
    one token per byte), ChatML's markers are plain text here, and the two counts differ."""
    ids = servers.tok.encode(LLAMA3_PROMPT, add_special_tokens=False).ids
    special_ids = {servers.tok.token_to_id(t) for t in SPECIALS}
    assert sum(i in special_ids for i in ids) == 1 + 3 + 3 + 2  # bos, 3 headers, 2 eot
    text = LLAMA3_PROMPT
    for t in SPECIALS:
        text = text.replace(t, "")
    assert len(ids) == len(text.encode()) + 9
    assert ids[0] == servers.tok.token_to_id("<|begin_of_text|>")
    assert _count(servers.tok, CHATML_PROMPT) == len(CHATML_PROMPT.encode())
    assert _count(servers.tok, CHATML_PROMPT) != len(ids)


def test_served_under_the_directory_name(servers: Servers) -> None:
    for url in (servers.own, servers.chatml):
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [NAME]


def test_llama3_checkpoint_answers_chat_with_its_own_template(servers: Servers) -> None:
    r = _chat(servers.own)
    assert len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None
    assert r.usage.prompt_tokens == _count(servers.tok, LLAMA3_PROMPT)
    assert 1 <= r.usage.completion_tokens <= 4


def test_chat_template_flag_replaces_the_checkpoints_template(servers: Servers) -> None:
    r = _chat(servers.chatml)
    assert len(r.choices) == 1
    assert r.usage is not None
    assert r.usage.prompt_tokens == _count(servers.tok, CHATML_PROMPT)
    assert r.usage.prompt_tokens != _count(servers.tok, LLAMA3_PROMPT)

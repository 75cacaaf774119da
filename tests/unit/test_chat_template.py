"""Chat templates rendered with Jinja the way transformers does: SmolLM2's GGUF template gives the
same bytes as the old hand-written ChatML, Llama 3 / Qwen2-style templates give what transformers
documents, errors (raise_exception, the sandbox, no template) are ChatTemplateError and HTTP 400,
and ``--chat-template FILE`` replaces the model's template."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.worker.app import ModelMeta, WorkerApp
from pd_fsm.io_trio.worker.backend import GenerateJob
from pd_fsm.io_trio.worker.config import ServeConfig, config_from_args
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.schedulers.request import RequestOutput
from pd_fsm.text.chat_template import ChatTemplate, ChatTemplateError
from pd_fsm.text.tokenizer import CharTokenizer, ChatMessage, HFTokenizer

# Llama-3-8B-Instruct's template, as in its tokenizer_config.json.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Qwen2-Instruct's template, laid out over lines with whitespace control as Qwen2.5's is.
QWEN2 = """\
{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

RAISING = "{% if messages[0]['role'] == 'user' %}{{ raise_exception('nope') }}{% endif %}x"

HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'x', 'content': 'y'}) }}",  # the immutable sandbox
]

CONVERSATIONS = [
    [ChatMessage("user", "Hi")],
    [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")],
    [
        ChatMessage("user", "What is the capital of France? Answer in one word."),
        ChatMessage("assistant", "Paris."),
        ChatMessage("user", "  And of Italy?\n"),
    ],
]


def old_render_chatml(
    messages: Iterable[ChatMessage], default_system: str | None, add_generation_prompt: bool
) -> str:
    """The hand-written renderer the Jinja path replaced (the oracle for byte-identity)."""
    msgs = list(messages)
    parts = []
    if default_system is not None and (not msgs or msgs[0].role != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts.extend(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in msgs)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _hf_tokenizer(chat_template: str | None) -> HFTokenizer:
    """A word-level vocabulary holding Llama 3's special tokens (bos 0, eos 1)."""
    from tokenizers import Tokenizer, models

    vocab = {"<|begin_of_text|>": 0, "<|eot_id|>": 1, "<unk>": 2, "hi": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    return HFTokenizer(tok.to_str(), eos_token_id=1, chat_template=chat_template, bos_token_id=0)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


# ----------------------------------------------------------------- rendering


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm2_gguf_template_matches_the_old_chatml(
    smollm2: LoadedModel, conversation: list[ChatMessage], add_generation_prompt: bool
) -> None:
    tok = smollm2.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.chat_template is not None
    assert "{%" in tok.chat_template  # the GGUF's own Jinja, not a hand-written format
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tok.apply_chat_template(conversation, add_generation_prompt) == old_render_chatml(
        conversation, default, add_generation_prompt
    )
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")  # ids 1 and 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_tiny_model_keeps_its_chatml(
    conversation: list[ChatMessage], add_generation_prompt: bool
) -> None:
    assert CharTokenizer().apply_chat_template(
        conversation, add_generation_prompt
    ) == old_render_chatml(conversation, None, add_generation_prompt)


def test_llama3_template_renders_as_transformers_documents() -> None:
    tok = _hf_tokenizer(LLAMA3)
    assert tok.bos_token == "<|begin_of_text|>"  # spelled from bos_token_id by the vocabulary
    chat = [ChatMessage("system", "You are a bot."), ChatMessage("user", " Hello! ")]
    assert tok.apply_chat_template(chat) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a bot.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.apply_chat_template(chat[1:], add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
    )


def test_qwen2_template_renders_as_transformers_documents() -> None:
    tok = _hf_tokenizer(QWEN2)
    assert tok.apply_chat_template([ChatMessage("user", "Hello!")]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello!")]
    assert tok.apply_chat_template(own, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    )


def test_environment_is_transformers() -> None:
    """trim_blocks / lstrip_blocks, loopcontrols, a tojson that keeps ``<>&``, tools and extra
    variables: what real templates (tool-calling ones especially) rely on."""
    blocks = ChatTemplate("  {% if add_generation_prompt %}\nA\n  {% endif %}\nB")
    assert blocks.render([], add_generation_prompt=True) == "A\nB"
    looped = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}|{{ tools | tojson }}|{{ flavour }}"
        "|{{ strftime_now('%Y') | length }}"
    )
    text = looped.render(
        [ChatMessage("user", "<a&b> café"), ChatMessage("user", "second")],
        tools=[{"name": "f"}],
        flavour="x",
    )
    assert text == '{"role": "user", "content": "<a&b> café"}|[{"name": "f"}]|x|4'
    assert ChatTemplate("{{ tools }}|{{ bos_token }}").render([]) == "None|"


def test_hf_checkpoint_template_is_found_where_transformers_looks(tmp_path: Path) -> None:
    from pd_fsm.jax_engine.model.registry import _hf_chat_template, _token_string

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": QWEN2}]
    assert _hf_chat_template(tmp_path, {"chat_template": named}) == QWEN2
    assert _hf_chat_template(tmp_path, {}) is None
    (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    assert _hf_chat_template(tmp_path, {}) == LLAMA3
    assert _hf_chat_template(tmp_path, {"chat_template": QWEN2}) == QWEN2
    cfg = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    assert (_token_string(cfg, "bos_token"), _token_string(cfg, "eos_token")) == ("<s>", "</s>")


# ----------------------------------------------------------------- errors


def test_raise_exception_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="nope"):
        _hf_tokenizer(RAISING).apply_chat_template([ChatMessage("user", "hi")])
    with pytest.raises(ChatTemplateError, match="nope"):
        CharTokenizer(chat_template=RAISING).apply_chat_template([ChatMessage("user", "hi")])


@pytest.mark.parametrize("source", HOSTILE)
def test_sandbox_refuses_python_internals(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="unsafe") as info:
        ChatTemplate(source).render([ChatMessage("user", "hi")])
    assert "<class" not in str(info.value) and "<function" not in str(info.value)


def test_syntax_error_fails_at_load() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _hf_tokenizer("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        CharTokenizer().with_chat_template("{{ messages[0] ")


def test_no_template_asks_for_the_flag() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template; pass --chat-template"):
        _hf_tokenizer(None).apply_chat_template([ChatMessage("user", "hi")])


# ----------------------------------------------------------------- --chat-template


def _serve_config(*flags: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", "--model", "tiny", *flags]))


def test_chat_template_flag_replaces_the_models_template(tmp_path: Path) -> None:
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3)
    config = _serve_config("--chat-template", str(path))
    assert config.chat_template == LLAMA3
    assert _serve_config().chat_template is None
    tiny = load_model("tiny")
    tok = ModelMeta.of(tiny, config).model.tokenizer
    assert tok.apply_chat_template([ChatMessage("user", "hi")]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"  # the tiny bos_token: ""
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The memoised model, shared with the scheduler, keeps its own template.
    assert tiny.tokenizer.apply_chat_template([ChatMessage("user", "hi")]).startswith(
        "<|im_start|>user"
    )


def test_bad_chat_template_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--chat-template .*missing\.jinja"):
        _serve_config("--chat-template", str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if add_generation_prompt %}")
    with pytest.raises(ValueError, match=r"broken\.jinja.*does not compile"):
        _serve_config("--chat-template", str(broken))


class _IdleBackend:
    """Ready, but never asked to generate: every request here fails at the chat template."""

    mode = "null"

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        raise AssertionError("the chat template should have failed first")
        yield  # pragma: no cover

    def abort(self, rid: str) -> bool:
        return False

    def ready(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}


async def _chat(worker: WorkerApp) -> httpx.Response:
    transport = httpx.ASGITransport(app=worker.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return await http.post("/v1/chat/completions", json=body)


async def test_raising_template_file_is_a_400(tmp_path: Path) -> None:
    path = tmp_path / "raising.jinja"
    path.write_text(RAISING)
    worker = WorkerApp(
        _serve_config("--chat-template", str(path)), _IdleBackend(), model=load_model("tiny")
    )
    r = await _chat(worker)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert "nope" in error["message"]


async def test_model_without_template_is_a_400() -> None:
    model = attrs.evolve(load_model("tiny"), tokenizer=_hf_tokenizer(None))
    r = await _chat(WorkerApp(ServeConfig(model="tiny"), _IdleBackend(), model=model))
    assert r.status_code == 400, r.text
    assert "--chat-template" in r.json()["error"]["message"]

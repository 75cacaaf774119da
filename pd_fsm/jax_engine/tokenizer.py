"""Tokenizers, the chat template and incremental (streaming) detokenization.

``HFTokenizer`` wraps a ``tokenizers.Tokenizer`` (byte-level BPE built from GGUF metadata);
``CharTokenizer`` maps ids 0..255 to the Latin-1 characters for the tiny random-weight model, so
that any id sequence decodes to text and the text-level logic (stop strings) is testable there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

CHATML_DEFAULT_SYSTEM_RE = re.compile(
    r"messages\[0\]\['role'\] != 'system'.*?<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S
)


@attrs.frozen
class ChatMessage:
    role: str
    content: str


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Iterable[ChatMessage], add_generation_prompt: bool = True
    ) -> str: ...


def render_chatml(
    messages: Iterable[ChatMessage], default_system: str | None, add_generation_prompt: bool
) -> str:
    """``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, as SmolLM2's template does
    (including its default system message when the conversation does not start with one)."""
    msgs = list(messages)
    parts = []
    if default_system is not None and (not msgs or msgs[0].role != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts.extend(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in msgs)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class HFTokenizer:
    def __init__(
        self,
        tokenizer_json: str,
        eos_token_id: int | Iterable[int],
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_str(tokenizer_json)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        self._eos = frozenset(eos)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        match = CHATML_DEFAULT_SYSTEM_RE.search(chat_template or "")
        self._default_system = match.group(1) if match else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        result = self._tok.token_to_id(token)
        return None if result is None else int(result)

    def apply_chat_template(
        self, messages: Iterable[ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        if self.chat_template is not None and "<|im_start|>" not in self.chat_template:
            raise ValueError("only ChatML chat templates are supported")
        return render_chatml(messages, self._default_system, add_generation_prompt)


class CharTokenizer:
    """Id ``i`` <-> ``chr(i)`` for ``i < vocab_size <= 256``; ``eos`` decodes to nothing."""

    def __init__(self, vocab_size: int = 256, eos_token_id: int = 0) -> None:
        if vocab_size > 256:
            raise ValueError("CharTokenizer covers Latin-1 only (vocab_size <= 256)")
        self._vocab = vocab_size
        self._eos = frozenset({eos_token_id})

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        ids = [min(ord(c), 255) for c in text]
        return [i if i < self._vocab else self._vocab - 1 for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            chr(i) for i in ids if not (skip_special_tokens and i in self._eos)
        )

    def apply_chat_template(
        self, messages: Iterable[ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        return render_chatml(messages, None, add_generation_prompt)


class IncrementalDetokenizer:
    """Text deltas for a growing id sequence, never splitting a multi-byte character.

    Decodes a short window of ids (prefix/read offsets, as vLLM and TGI do) rather than the whole
    sequence each step; a delta is held back while the window ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD), and ``flush()`` releases whatever is left when the request ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

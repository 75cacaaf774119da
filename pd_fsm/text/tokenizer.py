"""Tokenizers, their chat templates and incremental (streaming) detokenization.

``HFTokenizer`` wraps a ``tokenizers.Tokenizer`` (byte-level BPE built from GGUF metadata);
``CharTokenizer`` maps ids 0..255 to the Latin-1 characters for the tiny random-weight model, so
that any id sequence decodes to text and the text-level logic (stop strings) is testable there.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Self

from pd_fsm.text.chat_template import (
    CHATML_TEMPLATE,
    NO_TEMPLATE_MESSAGE,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
)

# ChatMessage is defined in chat_template (which renders it) and is part of this module's
# interface too: a Tokenizer's apply_chat_template takes them.
__all__ = ["CharTokenizer", "ChatMessage", "HFTokenizer", "IncrementalDetokenizer", "Tokenizer"]


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: Iterable[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...

    def with_chat_template(self, source: str) -> Self: ...


class HFTokenizer:
    """``bos_token`` / ``eos_token`` are the strings the chat template sees; by default the
    vocabulary's spelling of ``bos_token_id`` and of the first ``eos_token_id`` (GGUF metadata
    only has ids). An HF checkpoint passes its ``tokenizer_config.json`` strings instead, since
    its config may list several EOS ids of which the template means one."""

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_id: int | Iterable[int],
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_str(tokenizer_json)
        eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self._eos = frozenset(eos_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.bos_token = bos_token if bos_token is not None else self.id_to_token(bos_token_id)
        if eos_token is None and eos_ids:
            eos_token = self.id_to_token(eos_ids[0])
        self.eos_token = eos_token
        self.chat_template = chat_template
        # Compiled now: a template with a syntax error fails the model load, not a request.
        self._template = None if chat_template is None else ChatTemplate(chat_template)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """The ``tokenizers`` JSON (the grammar engine builds its own view from it)."""
        return str(self._tok.to_str())

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

    def id_to_token(self, token_id: int | None) -> str | None:
        result = None if token_id is None else self._tok.id_to_token(token_id)
        return None if result is None else str(result)

    def apply_chat_template(
        self,
        messages: Iterable[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The checkpoint's template rendered; ChatTemplateError when it has none or refuses."""
        if self._template is None:
            raise ChatTemplateError(NO_TEMPLATE_MESSAGE)
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
        )

    def with_chat_template(self, source: str) -> Self:
        """The same tokenizer (sharing the vocabulary) with ``source`` as its template
        (``--chat-template``)."""
        other = copy.copy(self)
        other._template = ChatTemplate(source)
        other.chat_template = source
        return other


class CharTokenizer:
    """Id ``i`` <-> ``chr(i)`` for ``i < 256``; ``eos`` decodes to nothing. A vocabulary past
    256 (a dummy model's, ``model/dummy.py``) encodes text as Latin-1 all the same and decodes
    its other ids as their code points (U+FFFD where that is no character)."""

    def __init__(
        self, vocab_size: int = 256, eos_token_id: int = 0, chat_template: str = CHATML_TEMPLATE
    ) -> None:
        self._vocab = vocab_size
        self._eos = frozenset({eos_token_id})
        # ChatML through the same Jinja path as real checkpoints, so the tiny model tests it.
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template)

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
            chr(i) if i < 0xD800 else "\ufffd" for i in ids
            if not (skip_special_tokens and i in self._eos)
        )

    def apply_chat_template(
        self,
        messages: Iterable[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        # No special-token spellings (eos decodes to nothing): empty, so that a --chat-template
        # written for a real model (``bos_token + ...``) still renders here.
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token="",
            tools=tools,
        )

    def with_chat_template(self, source: str) -> Self:
        other = copy.copy(self)
        other._template = ChatTemplate(source)
        other.chat_template = source
        return other


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

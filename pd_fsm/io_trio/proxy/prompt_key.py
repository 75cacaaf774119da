"""What the proxy's router sees of a request's prompt (``core.routing.Prompt``), read from the
body without a tokenizer: the proxy loads no model.

The text is what the routing index hashes, so it must start the same way for requests that share
a prefix: ``/generate``'s ``text`` or ``input_ids`` (written out as comma-separated ids),
``/v1/completions``' ``prompt``, and for chat each message as ``role\\ncontent\\n`` in order (the
chat template adds the same bytes to every message, so a shared history is a shared prefix here
as in the worker). The token count is exact for token ids and estimated at
``CHARS_PER_TOKEN`` characters a token for text — what conditional disaggregation's threshold is
compared with. A body the worker would refuse gives an empty prompt (its 400 comes from the
worker, and an empty prompt is never sent to D alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pd_fsm.core.routing import Prompt

# BPE tokenizers on English text. Measured with SmolLM2's: 4.4 characters a token on
# bench_prefix_cache.py's prompts, 3.2 on this project's README (markdown and code); the tiny
# test model's tokenizer is one character a token.
CHARS_PER_TOKEN = 4


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return value
    return None


def _text(value: object) -> Prompt:
    ids = _ids(value)
    if ids is not None:
        return Prompt(",".join(map(str, ids)), len(ids))
    if isinstance(value, str) and value:
        return Prompt(value, math.ceil(len(value) / CHARS_PER_TOKEN))
    return Prompt()


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_of(path: str, body: Mapping[str, object]) -> Prompt:
    if path == "/generate":
        ids = body.get("input_ids")
        return _text(ids if ids is not None else body.get("text"))
    if path == "/v1/completions":
        return _text(body.get("prompt"))
    messages = body.get("messages")
    if not isinstance(messages, list):
        return Prompt()
    text = "".join(f"{m.get('role', '')}\n{_content(m.get('content'))}\n"
                   for m in messages if isinstance(m, dict))
    return _text(text)

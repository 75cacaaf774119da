"""The one JSON parse every pd_fsm server runs at its edge: strict RFC 8259, bounded.

Python's ``json`` accepts more than JSON: the literals ``NaN``, ``Infinity`` and ``-Infinity``,
numbers that overflow to infinity (``1e400``), and ``\\ud800``-style escapes that leave a lone
surrogate in a ``str``. None of them can be written back out: httpx refuses NaN when the proxy
re-encodes a body for its legs, and UTF-8 refuses a lone surrogate when a tokenizer, a log line
or a JSON response meets it. Depth is the other hole: the C decoder recurses once per level and
a body nested 100,000 deep ends in ``RecursionError``. Before this module each of those was a
500 on a worker and a dead proxy process.

:func:`loads` refuses all of them with :class:`JsonError` — a ``ValueError`` carrying the HTTP
status to answer with (400, or 413 for a container over the size bound) and a message naming the
field (``sampling_params.temperature``) or the position. Valid JSON parses exactly as ``json``
parses it. The checks that need a walk over the tree (depth, container size, strings, big
integers) run only when a scan of the text in C says one could fail. Measured against
``json.loads`` in one run (``bench/bench_strict_json.py``, ``bench/RESULTS_edge.md``): 8 MB of
token ids 1.25-1.34x (no walk), a short ``/generate`` body 2.3x (4 µs), a chat of 2,000
messages 7-7.6x (2.6-4.9 ms: its objects go through the duplicate-key hook and the walk).

Duplicate object keys are refused too. RFC 8259 leaves their meaning open ("SHOULD be unique")
and parsers disagree (Python keeps the last, serde's derived structs refuse them), so a body that
the proxy and a worker or the sglang-router would read differently is not accepted at all.
"""

from __future__ import annotations

import json
import re
from typing import TypeAlias

import attrs

# What a parse returns. Lists and dicts hold more of the same.
JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"

# Integers must fit in 64 bits (signed or unsigned): every integer field pd_fsm reads does (ids,
# counts, seeds, rooms), and a bigger one would overflow where it meets numpy or JAX.
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
# 2**63 has 19 digits: shorter runs cannot overflow. Found by mapping every byte to "0" (a digit)
# or " " and searching for 19 zeros: both passes are C loops (a regex took 135 ms on 8 MB).
_DIGITS_AS_ZEROS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * 19
# A \uD800-\uDFFF escape: the only way a lone surrogate gets into text that decoded as UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATES = re.compile("[\ud800-\udfff]")


@attrs.frozen
class JsonLimits:
    """How deep and how wide a document may be."""

    max_depth: int = 64  # nesting of arrays and objects; a request body needs ~6
    max_items: int = 1_048_576  # members of one array or object; 1M token ids is 8 MB of JSON


DEFAULT_LIMITS = JsonLimits()


class JsonError(ValueError):
    """The document is not strict JSON within the limits: answer ``status`` with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.frozen
class _NonFinite:
    """Stands in for a NaN/Infinity literal or an overflowing number until the walk names its
    field."""

    literal: str


@attrs.frozen
class _DuplicateKey:
    """Stands in for an object with a repeated key until the walk names its field."""

    key: str


def loads(data: bytes | str, limits: JsonLimits = DEFAULT_LIMITS, *, what: str = "body"
          ) -> JsonValue:
    """``data`` parsed as strict JSON within ``limits``, or :class:`JsonError`.

    ``what`` names the document in messages ("body", "record"); fields are named below it
    (``body.sampling_params.temperature``, ``body.messages[2].content``)."""
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonError(400, f"malformed JSON: the {what} is not UTF-8: byte {exc.start} "
                                 f"(0x{exc.object[exc.start]:02x}) {exc.reason}") from None
    else:
        text = data
        raw = data.encode("utf-8", "surrogatepass")
    if text.startswith("\ufeff"):  # RFC 8259 §8.1: no byte order mark
        raise JsonError(400, f"malformed JSON: the {what} starts with a byte order mark (U+FEFF)")
    suspects: list[object] = []

    def constant(literal: str) -> object:
        marker = _NonFinite(literal)
        suspects.append(marker)
        return marker

    def number(literal: str) -> object:
        value = float(literal)
        if value in (float("inf"), float("-inf")):
            return constant(literal)
        return value

    def pairs(items: list[tuple[str, JsonValue]]) -> object:
        out: dict[str, JsonValue] = dict(items)
        if len(out) == len(items):
            return out
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                break
            seen.add(key)
        marker = _DuplicateKey(key)
        suspects.append(marker)
        return marker

    try:
        value: JsonValue = json.loads(text, parse_constant=constant, parse_float=number,
                                      object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise JsonError(400, f"malformed JSON: {exc.msg} (line {exc.lineno}, column "
                             f"{exc.colno}, char {exc.pos})") from None
    except RecursionError:  # the C decoder recurses per level; far past our bound anyway
        raise JsonError(400, f"{what} nests arrays/objects deeper than {limits.max_depth} "
                             "levels") from None
    except ValueError as exc:  # an integer over Python's 4300-digit conversion limit
        raise JsonError(400, f"{what}: {exc}") from None
    if suspects or _needs_walk(text, raw, limits):
        _check(value, limits, what)
    return value


def _needs_walk(text: str, raw: bytes, limits: JsonLimits) -> bool:
    """Whether anything the walk checks could fail: each test is one pass in C."""
    return (
        text.count("[") + text.count("{") > limits.max_depth
        or text.count(",") >= limits.max_items
        or _SURROGATE_ESCAPE.search(text) is not None
        or _LONG_RUN in raw.translate(_DIGITS_AS_ZEROS)
    )


# A node of the walk: (value, its key in the parent, the parent's node, depth). The path is built
# from the parents only when a problem is found: building it for every node made the walk 3x
# slower.
_Node = tuple[object, "str | int | None", "_Node | None", int]


def _check(root: JsonValue, limits: JsonLimits, what: str) -> None:
    """Walk the tree (no recursion: the depth is what is being checked) and refuse the first
    problem, named by its field."""
    stack: list[_Node] = [(root, None, None, 0)]
    while stack:
        node = stack.pop()
        value, _, _, depth = node
        if isinstance(value, str):
            lone = _SURROGATES.search(value)
            if lone is not None:
                raise _surrogate(lone, _path(node, what))
        elif isinstance(value, dict):
            _check_container(value, node, limits, what)
            for key in value:
                lone = _SURROGATES.search(key)
                if lone is not None:
                    raise _surrogate(lone, f"a key of {_path(node, what)}")
            stack.extend((v, k, node, depth + 1) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            _check_container(value, node, limits, what)
            stack.extend((value[i], i, node, depth + 1) for i in range(len(value) - 1, -1, -1))
        elif isinstance(value, bool | float) or value is None:
            pass
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                raise JsonError(400, f"{_path(node, what)} is an integer outside 64 bits "
                                     f"({len(str(abs(value)))} digits)")
        elif isinstance(value, _NonFinite):
            raise JsonError(400, f"{_path(node, what)} is {value.literal}: JSON numbers must "
                                 "be finite")
        elif isinstance(value, _DuplicateKey):
            raise JsonError(400, f"{_path(node, what)} has the key {_shown(value.key)} more "
                                 "than once")


def _check_container(value: list[JsonValue] | dict[str, JsonValue], node: _Node,
                     limits: JsonLimits, what: str) -> None:
    if node[3] >= limits.max_depth:
        raise JsonError(400, f"{_path(node, what)} nests arrays/objects deeper than "
                             f"{limits.max_depth} levels")
    if len(value) > limits.max_items:
        raise JsonError(413, f"{_path(node, what)} has {len(value)} members, over the limit "
                             f"of {limits.max_items}")


def _path(node: _Node, what: str) -> str:
    parts: list[str] = []
    at: _Node | None = node
    while at is not None and at[2] is not None:
        key = at[1]
        parts.append(f"[{key}]" if isinstance(key, int) else _field(str(key)))
        at = at[2]
    path = what + "".join(reversed(parts))
    # A path 64 levels deep is long: its start and its end say where it is.
    return path if len(path) <= 120 else f"{path[:70]}...{path[-40:]}"


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _field(key: str) -> str:
    """``.key``, or ``['key']`` (escaped, shortened) for a key that is not a plain name: a
    message must itself be safe to print and to encode."""
    return f".{key}" if _NAME.fullmatch(key) else f"[{_shown(key)}]"


def _shown(text: str) -> str:
    # ascii(): escapes lone surrogates and control characters alike.
    return ascii(text if len(text) <= 40 else text[:40] + "...")


def _surrogate(lone: re.Match[str], path: str) -> JsonError:
    return JsonError(400, f"{path} has a lone surrogate U+{ord(lone.group()):04X} at character "
                          f"{lone.start()} (escapes must pair into one code point)")

"""Command-line flags as data: each ``Flag`` is declared once — its names, how its
value is parsed and checked, its help and README text, and its counterpart in RFC-2 §7 or in
sglang's server arguments — and everything else is derived from the records: the argparse
arguments (``add_flags``), the reading of parsed arguments into a config object's fields
(``read_flags``) and the README's table (``markdown_table``).

Defaults and parse types are not repeated here: a flag whose ``dest`` is a field of the config
class takes that field's default and annotated type. Flags read together or from a file at start
go through a ``Hook`` each, which names the flags it reads and the field it sets, so that
``unaccounted`` can tell when a field or a flag has been left out.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

# A check of a parsed value: raises ValueError naming the flag (its first argument).
Check = Callable[[str, Any], None]

# What a field annotated with one of these names is parsed with (``X | None``: the same).
_PARSE_TYPES: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "str": str, "Path": Path, "bool": bool,
}


def above(bound: float) -> Check:
    def check(name: str, value: Any) -> None:
        if value <= bound:
            raise ValueError(f"{name} must be > {bound:g}")

    return check


positive = above(0)


def at_least(bound: int) -> Check:
    def check(name: str, value: Any) -> None:
        if value < bound:
            raise ValueError(f"{name} must be >= {bound}")

    return check


def within(low: int, high: int, *, show_value: bool = False) -> Check:
    def check(name: str, value: Any) -> None:
        if not low <= value <= high:
            got = f", got {value}" if show_value else ""
            raise ValueError(f"{name} must be in {low}..{high}{got}")

    return check


@attrs.frozen
class Flag:
    """One flag. ``help`` is argparse's (``%(default)s`` and the like expand there and in the
    README); ``doc``, when given, is the README's longer text."""

    name: str
    help: str
    aliases: tuple[str, ...] = attrs.field(default=(), kw_only=True)
    dest: str = attrs.field(kw_only=True)
    doc: str | None = attrs.field(default=None, kw_only=True)
    # Parses the command-line string; None: the config field's annotated type (``bool``: a
    # switch, store_true), or ``str`` for a flag that is no field.
    type: Callable[[str], Any] | None = attrs.field(default=None, kw_only=True)
    choices: tuple[str, ...] | None = attrs.field(default=None, kw_only=True)
    metavar: str | None = attrs.field(default=None, kw_only=True)
    check: Check | None = attrs.field(default=None, kw_only=True)
    env: str | None = attrs.field(default=None, kw_only=True)  # its default, when set
    shown_default: str | None = attrs.field(default=None, kw_only=True)  # README's wording
    exclusive: str | None = attrs.field(default=None, kw_only=True)  # argparse group key
    rfc2: bool = attrs.field(default=False, kw_only=True)  # one of RFC-2 §7's names
    sglang: str | None = attrs.field(default=None, kw_only=True)  # sglang's flag for the same

    @dest.default
    def _dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def label(self) -> str:
        """The name error messages use: the one ``dest`` is spelled after, where there is one."""
        spelled = "--" + self.dest.replace("_", "-")
        return spelled if spelled in self.names else self.name

    def validate(self, value: Any) -> None:
        """Raise ValueError naming the flag for a bad value (None: not given, nothing to check).
        Choices are checked again because argparse does not check a default (``env``)."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(
                f"{self.label} must be one of {', '.join(self.choices)}, got {value!r}"
            )
        if self.check is not None:
            self.check(self.label, value)


@attrs.frozen
class Hook:
    """Flags that are not copied to a field as they are: read together (checked against each
    other) or from a file at start. ``run(args)`` raises ValueError naming a bad value and
    returns the value of ``field``; a hook without a field only checks."""

    field: str | None
    reads: tuple[str, ...]  # the dests of the flags it reads
    run: Callable[[argparse.Namespace], Any]


def _fields(config: type | None) -> Mapping[str, attrs.Attribute[Any]]:
    return {} if config is None else attrs.fields_dict(config)


def parse_type(flag: Flag, config: type | None = None) -> Callable[[str], Any]:
    if flag.type is not None:
        return flag.type
    field = _fields(config).get(flag.dest)
    if field is None:
        return str
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    parse = _PARSE_TYPES.get(annotation.removesuffix(" | None"))
    if parse is None:
        raise TypeError(f"{flag.name}: field {flag.dest} is a {field.type}: give the flag a type")
    return parse


def config_default(flag: Flag, config: type | None = None) -> Any:
    """The default the config declares for the flag's field (False for a switch that is none)."""
    field = _fields(config).get(flag.dest)
    if field is not None and field.default is not attrs.NOTHING:
        return field.default
    return False if parse_type(flag, config) is bool else None


def argparse_kwargs(flag: Flag, config: type | None = None) -> dict[str, Any]:
    default = config_default(flag, config)
    if flag.env is not None:
        default = os.environ.get(flag.env, default)
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": default, "help": flag.help}
    parse = parse_type(flag, config)
    if parse is bool:
        return {**kwargs, "action": "store_true"}
    if parse is not str:
        kwargs["type"] = parse
    if flag.choices is not None:
        kwargs["choices"] = flag.choices
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    return kwargs


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag],
              config: type | None = None) -> None:
    """An argument per flag, in order; flags with one ``exclusive`` key exclude each other."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for flag in flags:
        target: argparse._ActionsContainer = parser
        if flag.exclusive is not None:
            if flag.exclusive not in groups:
                groups[flag.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[flag.exclusive]
        target.add_argument(*flag.names, **argparse_kwargs(flag, config))


def read_flags(args: argparse.Namespace, flags: Sequence[Flag], hooks: Sequence[Hook],
               config: type) -> dict[str, Any]:
    """The config's fields from parsed arguments: every flag checked, in order; a flag named as
    a field copied to it; then each hook, in order, sets its field."""
    for flag in flags:
        flag.validate(getattr(args, flag.dest))
    fields = _fields(config)
    values = {flag.dest: getattr(args, flag.dest) for flag in flags if flag.dest in fields}
    for hook in hooks:
        value = hook.run(args)
        if hook.field is not None:
            values[hook.field] = value
    return values


def unaccounted(flags: Sequence[Flag], hooks: Sequence[Hook], config: type) -> list[str]:
    """What ``read_flags`` would drop or miss: a field no flag or hook sets, a flag nothing
    reads, a hook reading a flag that does not exist or setting a field that does not."""
    fields = _fields(config)
    dests = {flag.dest for flag in flags}
    read = {dest for hook in hooks for dest in hook.reads}
    set_by = dests | {hook.field for hook in hooks}
    problems = [f"field {name}: no flag or hook sets it" for name in fields if name not in set_by]
    problems += [f"flag {flag.name}: neither a field nor read by a hook" for flag in flags
                 if flag.dest not in fields and flag.dest not in read]
    problems += [f"a hook reads {dest}, which no flag sets" for dest in sorted(read - dests)]
    problems += [f"a hook sets {hook.field}, which is no field" for hook in hooks
                 if hook.field is not None and hook.field not in fields]
    return problems

"""Declarative option parsing: a frozen dataclass whose fields carry their own rule.

Each option is a dataclass field made by :func:`option` with a :class:`Rule` (what values it
takes and how to say so); :func:`parse` is the one validator: it refuses unknown keys
(naming the allowed ones), converts and checks every given value, and raises ``ValueError``
naming the key as the user wrote it (``release.sink_blocks``), the bad value and what is
allowed. Checks that relate several options live in the config class's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Rule:
    """What one option accepts.

    Attributes:
        allowed: the accepted values in words, for the error (``"a positive int"``).
        check: True when a (converted) value is accepted.
        convert: applied to the given value before the check (e.g. a comma list to a
            tuple); None leaves it as given.
    """

    allowed: str
    check: Callable[[Any], bool]
    convert: Callable[[Any], Any] | None = None


def option(default: Any, rule: Rule, *, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its :class:`Rule` (``factory`` for mutable defaults)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"rule": rule})
    return dataclasses.field(default=default, metadata={"rule": rule})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(minimum: int, *, nullable: bool = False, allowed: str | None = None) -> Rule:
    """An int ``>= minimum`` (or null when ``nullable``)."""
    words = allowed or (f"an int >= {minimum}" if minimum != 1 else "a positive int")
    return Rule(
        words + (" or null" if nullable else ""),
        lambda v: (nullable and v is None) or (_is_int(v) and v >= minimum),
    )


def number(
    *,
    above: float | None = None,
    at_most: float | None = None,
    nullable: bool = False,
    allowed: str = "a number",
) -> Rule:
    """A number in ``(above, at_most]`` (bounds optional; or null when ``nullable``)."""
    return Rule(
        allowed + (" or null" if nullable else ""),
        lambda v: (
            (nullable and v is None)
            or (
                _is_number(v) and (above is None or v > above) and (at_most is None or v <= at_most)
            )
        ),
    )


def choice(values: Sequence[str]) -> Rule:
    """One of ``values``."""
    return Rule(f"one of {list(values)}", lambda v: isinstance(v, str) and v in values)


def boolean() -> Rule:
    return Rule("true or false", lambda v: isinstance(v, bool))


def text(*, nullable: bool = False, allowed: str = "a non-empty string") -> Rule:
    return Rule(
        allowed + (" or null" if nullable else ""),
        lambda v: (nullable and v is None) or (isinstance(v, str) and bool(v)),
    )


def mapping(*, nullable: bool = False, allowed: str = "an object (mapping)") -> Rule:
    return Rule(
        allowed,
        lambda v: (nullable and v is None) or isinstance(v, Mapping),
    )


def names(values: Sequence[str]) -> Rule:
    """A non-empty list of distinct names from ``values`` (a comma list is split)."""

    def convert(value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return tuple(value) if isinstance(value, list | tuple) else value

    return Rule(
        f"a non-empty list of distinct names from {list(values)}",
        lambda v: (
            isinstance(v, tuple)
            and bool(v)
            and all(name in values for name in v)
            and len(set(v)) == len(v)
        ),
        convert,
    )


def parse(
    cls: type[T], options: Mapping[str, Any] | None, where: str, prefix: str = "", **fixed: Any
) -> T:
    """Build ``cls`` from ``options``: every key known, every value checked by its rule.

    Args:
        cls: a dataclass whose fields were made by :func:`option`.
        options: the user's keys and values (None: all defaults).
        where: what the options are, for the unknown-key error
            (``"kv_connector_extra_config"``, ``"release"``).
        prefix: prepended to a key in errors (``"release."``).
        fixed: values of fields that are not options (no rule), passed through.

    Raises:
        ValueError: an unknown key (naming the allowed ones), or a value its rule refuses
            (naming the key, the value and what is allowed).
    """
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"{where} must be an object, got {options!r}")
    given = dict(options or {})
    rules: dict[str, Rule] = {
        f.name: f.metadata["rule"]
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if "rule" in f.metadata
    }
    unknown = sorted(set(given) - set(rules))
    if unknown:
        allowed = sorted(set(rules) | set(fixed))
        raise ValueError(f"unknown {where} option(s) {unknown}; allowed: {allowed}")
    values: dict[str, Any] = dict(fixed)
    for name, value in given.items():
        rule = rules[name]
        if rule.convert is not None:
            value = rule.convert(value)
        if not rule.check(value):
            raise ValueError(f"{prefix}{name} must be {rule.allowed}, got {value!r}")
        values[name] = value
    return cls(**values)

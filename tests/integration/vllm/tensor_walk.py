"""Find tensors anywhere inside an object (metadata that must carry ids, never KV)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

_SCALARS = (str, bytes, int, float, bool, type(None))


def tensors_in(value: Any, seen: set[int] | None = None) -> Iterator[str]:
    """Type names of every tensor reachable from ``value`` (dataclasses, containers, objects)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, _SCALARS):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield type(value).__name__
        return
    if isinstance(value, dict):
        children: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    elif dataclasses.is_dataclass(value):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())
    else:
        return
    for child in children:
        yield from tensors_in(child, seen)

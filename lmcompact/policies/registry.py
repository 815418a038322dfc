"""Policy registry: built-ins by lazy module path, third parties by entry point.

Built-in policies are listed as ``name -> "module:Class"`` and imported on first
use, so ``lmcompact policies`` does not import every policy module up front.
A separate package adds a policy without touching lmcompact::

    [project.entry-points."lmcompact.policies"]
    my_policy = "my_package.policy:MyPolicy"

``register_policy`` also registers a class at run time (tests, notebooks).
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import Any, TypeVar

from lmcompact.policies.base import CompactionPolicy

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmcompact.policies"

_BUILTIN: dict[str, str] = {
    "none": "lmcompact.policies.none:KeepAll",
    "random": "lmcompact.policies.random:RandomPolicy",
    "streaming_llm": "lmcompact.policies.streaming_llm:StreamingLLM",
    "h2o": "lmcompact.policies.h2o:H2O",
    "tova": "lmcompact.policies.tova:TOVA",
    "snapkv": "lmcompact.policies.snapkv:SnapKV",
    "decoding_snapkv": "lmcompact.policies.decoding_snapkv:DecodingSnapKV",
    "chunkkv": "lmcompact.policies.chunkkv:ChunkKV",
    "rkv": "lmcompact.policies.rkv:RKV",
    "pyramidkv": "lmcompact.policies.pyramidkv:PyramidKV",
    "adakv": "lmcompact.policies.adakv:AdaKV",
    "knorm": "lmcompact.policies.knorm:KNorm",
    "fastgen": "lmcompact.policies.fastgen:FastGen",
    "duoattention": "lmcompact.policies.duoattention:DuoAttention",
    "kvzip": "lmcompact.policies.kvzip:KVzip",
    "expected_attention": "lmcompact.policies.expected_attention:ExpectedAttention",
    "self_info": "lmcompact.policies.self_info:SelfInformation",
}

_registered: dict[str, type[CompactionPolicy]] = {}

P = TypeVar("P", bound=type[CompactionPolicy])


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls!r} needs a non-empty class attribute 'name' to be registered")
    existing = _registered.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"policy name {name!r} is already registered by {existing!r}")
    _registered[name] = cls
    return cls


def _import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_policies() -> list[str]:
    """Every policy name: built-ins, run-time registrations and entry-point plugins."""
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_points()))


def get_policy_class(name: str) -> type[CompactionPolicy]:
    """Look a policy class up by name; ValueError lists the names that exist."""
    if name in _registered:
        return _registered[name]
    target: Any
    if name in _BUILTIN:
        target = _import_target(_BUILTIN[name])
    else:
        plugin = _entry_points().get(name)
        if plugin is None:
            raise ValueError(
                f"unknown policy {name!r}; available: {', '.join(available_policies())}"
            )
        target = plugin.load()
    if not (isinstance(target, type) and issubclass(target, CompactionPolicy)):
        raise ValueError(f"policy {name!r} resolves to {target!r}, not a CompactionPolicy")
    if target.name != name:
        raise ValueError(f"policy entry {name!r} points at a class named {target.name!r}")
    _registered[name] = target
    return target


def make_policy(name: str, **params: Any) -> CompactionPolicy:
    """Instantiate policy ``name`` with hyper-parameters; unknown ones raise ValueError."""
    cls = get_policy_class(name)
    try:
        return cls(**params)
    except TypeError as error:
        allowed = ", ".join(cls.describe()["params"])
        raise ValueError(
            f"bad parameters for policy {name!r}: {error}; allowed: {allowed}"
        ) from None

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from lmcompact.store import ChunkKeyer, StoreConfig, StoreNamespace, TieredStore, chunk_keys
from tests.unit.store.store_helpers import make_chunk, make_namespace

TOKENS = list(range(1000, 1000 + 700))


def test_keys_per_full_chunk_and_partial():
    ns = make_namespace()
    assert len(chunk_keys(TOKENS, ns, 256)) == 2
    assert len(chunk_keys(TOKENS, ns, 256, include_partial=True)) == 3
    assert len(chunk_keys(TOKENS[:255], ns, 256)) == 0


def test_keys_are_stable_golden():
    # A change here breaks every stored entry: bump FORMAT_VERSION instead.
    keys = chunk_keys(TOKENS, make_namespace(), 256)
    assert keys[0].hex()[:16] == GOLDEN_FIRST_KEY


GOLDEN_FIRST_KEY = "b4b7ec8cac3d9080"


def test_input_types_agree():
    ns = make_namespace()
    expected = chunk_keys(TOKENS, ns, 128)
    assert chunk_keys(np.array(TOKENS, dtype=np.int32), ns, 128) == expected
    assert chunk_keys(torch.tensor(TOKENS), ns, 128) == expected


def test_prefix_chaining():
    ns = make_namespace()
    base = chunk_keys(TOKENS, ns, 256)
    late = list(TOKENS)
    late[300] += 1  # second chunk changes: first key same, second differs
    changed = chunk_keys(late, ns, 256)
    assert changed[0] == base[0] and changed[1] != base[1]
    early = list(TOKENS)
    early[0] += 1  # first chunk changes: every key differs (prefix chain)
    assert all(a != b for a, b in zip(chunk_keys(early, ns, 256), base, strict=True))


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"kv_dtype": "float16"},
        {"kv_layout": "other"},
        {"tp_rank": 1, "tp_world_size": 2},
        {"tp_world_size": 2},
        {"policy_name": "snapkv"},
        {"policy_params": {"budget": 0.5}},
        {"format_version": 2},
    ],
)
def test_every_namespace_field_changes_keys(change):
    base = chunk_keys(TOKENS, make_namespace(), 256)
    other = chunk_keys(TOKENS, make_namespace(**change), 256)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_chunk_size_changes_keys():
    ns = make_namespace()
    assert chunk_keys(TOKENS, ns, 256)[0] != chunk_keys(TOKENS[:512], ns, 256 * 2)[0]


def test_policy_params_are_canonical():
    a = make_namespace(policy_params={"budget": 0.5, "window": 32})
    b = make_namespace(policy_params={"window": 32, "budget": 0.5})
    assert a == b and a.digest() == b.digest()
    assert a.policy_params_json == '{"budget":0.5,"window":32}'


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_id": ""}, "model_id"),
        ({"tp_rank": 2, "tp_world_size": 2}, "tp_rank"),
        ({"tp_world_size": 0}, "tp_world_size"),
        ({"policy_params": {"x": object()}}, "policy_params"),
        ({"policy_params": {"x": float("nan")}}, "policy_params"),
    ],
)
def test_namespace_validation(change, field):
    with pytest.raises(ValueError, match=field):
        make_namespace(**change)


def test_bad_token_input_and_chunk_size():
    ns = make_namespace()
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkKeyer(ns, 0)
    with pytest.raises(ValueError, match="1-D"):
        chunk_keys(np.zeros((2, 256), dtype=np.int64), ns)
    with pytest.raises(ValueError, match="integers"):
        chunk_keys([0.5] * 256, ns)


def test_namespace_is_hashable_and_frozen():
    ns = make_namespace(policy_params={"b": 1})
    assert hash(ns) == hash(make_namespace(policy_params={"b": 1}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns.model_id = "x"  # type: ignore[misc]


def test_lookup_prefix_counts_consecutive_hits():
    ns = make_namespace()
    keys = chunk_keys(list(range(256 * 5)), ns, 256)
    store = TieredStore(
        ns, StoreConfig(gpu_capacity_bytes=1 << 20, cpu_capacity_bytes=1 << 20, gpu_device="cpu")
    )
    assert store.lookup_prefix(keys) == 0
    store.put(keys[0], make_chunk(0))
    store.tier("cpu").put(keys[1], make_chunk(1))  # lower tier only
    store.put(keys[3], make_chunk(3))
    assert store.lookup_prefix(keys) == 2
    store.put(keys[2], make_chunk(2))
    assert store.lookup_prefix(keys) == 4
    assert store.lookup_prefix([]) == 0
    assert isinstance(ns, StoreNamespace)

"""How many key splits the per-head launch takes (lmcompact.kernels.entry_attention)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.kernels import paged_attention
from lmcompact.kernels.entry_attention import SCRATCH_BYTES, entry_splits


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "_sm_count", lambda device: 132)


def splits(num_reqs: int, q_len: int, tokens: int, max_keys: int = 16448) -> int:
    # the 8B shape: 8 kv heads, 32 query heads of 128
    return entry_splits(num_reqs, q_len, 8, 32, 128, tokens, max_keys, torch.device("cpu"))


def test_a_decode_step_splits_as_flash_decoding() -> None:
    # 8 programs per split for one request: 16 x 132 / 8 = 264 wanted, 16448 / (4 x 64)
    # = 64 allowed (>= 4 key tiles each)
    assert splits(1, 1, 1) == 64
    assert splits(24, 1, 24) == 8  # cdiv(2112, 192) = 11 -> 8 (a power of two)
    assert splits(1, 1, 1, max_keys=1024) == 4  # short prefixes: 4 tiles a split


def test_a_short_prefill_after_a_load_splits_its_keys() -> None:
    # 256 queries x 4 heads of a group = 16 tiles of 64 rows, x 8 heads = 128 programs:
    # fewer than the SMs, each over a whole head's cells without splits
    assert splits(1, 256, 256) == 16


def test_a_long_prefill_stays_whole_within_the_scratch() -> None:
    assert splits(4, 2048, 8192) == 1  # 4096 programs fill the device already
    # one request's 16384-token chunk: 8192 programs, and partials of more than one split
    # would pass the scratch limit
    assert splits(1, 16384, 16384) == 1
    assert splits(64, 4, 256, max_keys=1 << 20) * 256 * 32 * 128 * 4 <= SCRATCH_BYTES


def test_heads_must_group() -> None:
    with pytest.raises(ValueError, match="multiple"):
        entry_splits(1, 1, 3, 8, 128, 1, 1024, torch.device("cpu"))

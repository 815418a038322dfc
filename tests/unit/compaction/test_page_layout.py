"""Token-level reads and writes of paged K/V (``lmcompact.compaction.page_layout``)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.page_layout import CpuPageLayout, GpuPageLayout, make_layout


@pytest.mark.parametrize("layout_cls", [CpuPageLayout, GpuPageLayout])
def test_layout_write_read_round_trip(layout_cls: type) -> None:
    bs, h, d = 32, 3, 8
    layout = layout_cls(bs)
    kv = torch.zeros(6, h, bs, 2 * d)
    keys, values = torch.randn(h, 2 * bs, d), torch.randn(h, 2 * bs, d)
    layout.write(kv, [4, 1, 5], bs, keys, values)  # logical blocks 1, 2 -> physical 1, 5
    got_k, got_v = layout.read(kv, [4, 1, 5], bs + 3, 2 * bs - 3)
    assert torch.equal(got_k, keys[:, 3:]) and torch.equal(got_v, values[:, 3:])
    assert kv[4].abs().sum() == 0  # untouched block
    with pytest.raises(ValueError, match="whole pages"):
        layout.write(kv, [4, 1, 5], 3, keys, values)


def test_cpu_layout_stores_keys_transposed() -> None:
    bs, d = 32, 4
    kv = torch.zeros(1, 1, bs, 2 * d)
    keys = torch.arange(bs * d, dtype=torch.float32).view(1, bs, d)
    make_layout("head_major_kt", bs).write(kv, [0], 0, keys, -keys)
    page = kv[0, 0].reshape(-1)
    assert torch.equal(page[: bs * d].view(d, bs), keys[0].T)  # K^T first
    assert torch.equal(page[bs * d :].view(bs, d), -keys[0])  # then V token-major

"""fp8 pages: decoding, packs that score numbers and move bytes, saves that keep bytes."""

from __future__ import annotations

import pytest
import torch

from lmcompact.compaction.kv_quant import Fp8Pages, fp8_format, is_fp8
from lmcompact.compaction.pack import WindowQueries, pack_in_place
from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.save_job import SaveJob, compact_job
from lmcompact.policies import make_policy
from lmcompact.store import ChunkKey

BS, H, D = 8, 2, 4
SCALES = (0.5, 2.0)  # per layer


def fp8_paged(num_blocks: int, seed: int, element: torch.dtype) -> torch.Tensor:
    """uint8 pages holding fp8 numbers of a normal distribution."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, H, BS, 2 * D, generator=gen).to(element).view(torch.uint8)


def test_formats_and_decoding() -> None:
    assert is_fp8("fp8") and is_fp8("fp8_e5m2") and not is_fp8("auto")
    assert fp8_format("fp8") == fp8_format("fp8_e4m3") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_e5m2"):
        fp8_format("fp8_inc")
    pages = Fp8Pages.of("fp8", [0.5, 2.0], [1.0, 4.0])
    raw = torch.tensor([1.0, -3.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert pages.keys(1, raw).tolist() == [2.0, -6.0]
    assert pages.values(1, raw).tolist() == [4.0, -12.0]
    stacked = pages.stacked_keys(torch.stack([raw, raw]))
    assert stacked.tolist() == [[0.5, -1.5], [2.0, -6.0]]
    assert not pages.unit_scales and Fp8Pages.of("fp8", [1.0], [1.0]).unit_scales
    with pytest.raises(ValueError, match="uint8"):
        pages.keys(0, torch.zeros(2))


@pytest.mark.parametrize("element", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pack_scores_numbers_and_moves_bytes(element: torch.dtype) -> None:
    """The fp8 pack chooses what a float pack of the decoded numbers chooses, and its
    kept slots hold the original bytes (no decode/encode round trip)."""
    layout = make_layout("head_major_kt", BS)
    name = "fp8" if element == torch.float8_e4m3fn else "fp8_e5m2"
    pages = Fp8Pages.of(name, SCALES, SCALES)
    raw_layers = [fp8_paged(6, seed, element) for seed in (0, 1)]
    row = [4, 0, 2, 5, 1]
    gen = torch.Generator().manual_seed(3)
    queries = [torch.randn(4, H, D, generator=gen) for _ in raw_layers]
    window = WindowQueries(queries, torch.arange(4 * BS - 4, 4 * BS), scale=1.0)
    policy = make_policy("snapkv", budget=BS, window_size=4, kernel_size=1)
    before = [layout.read(kv, row, 0, 4 * BS) for kv in raw_layers]
    float_layers = [
        kv.view(element).float() * SCALES[i] for i, kv in enumerate(raw_layers)
    ]  # same scale for K and V here, so a whole-page decode is exact
    expected = pack_in_place(float_layers, layout, row, 4 * BS, BS, policy, window)
    chosen = pack_in_place(raw_layers, layout, row, 4 * BS, BS, policy, window, fp8=pages)
    for layer, kv in enumerate(raw_layers):
        assert kv.dtype == torch.uint8
        assert [c.tolist() for c in chosen[layer]] == [e.tolist() for e in expected[layer]]
        keys, values = layout.read(kv, row, 0, BS)
        index = torch.stack(chosen[layer])
        old_keys, old_values = before[layer]
        for head in range(H):
            assert torch.equal(keys[head], old_keys[head, index[head]])
            assert torch.equal(values[head], old_values[head, index[head]])
    raw_chosen = pack_in_place(
        [fp8_paged(6, s, element) for s in (0, 1)], layout, row, 4 * BS, BS, policy, window
    )
    as_lists = [[c.tolist() for c in heads] for heads in chosen]
    assert [
        [c.tolist() for c in heads] for heads in raw_chosen
    ] != as_lists  # scoring the bytes as numbers would choose otherwise


def test_fp8_save_keeps_bytes_and_scores_numbers() -> None:
    """A compacted save of fp8 pages stores uint8 rows: the bytes of the tokens a save
    of the decoded numbers keeps."""
    element = torch.float8_e4m3fn
    layout = make_layout("head_major_kt", BS)
    pages = Fp8Pages.of("fp8", SCALES, SCALES)
    raw = [fp8_paged(4, seed, element) for seed in (5, 6)]
    decoded = [kv.view(element).float() * SCALES[i] for i, kv in enumerate(raw)]
    gen = torch.Generator().manual_seed(4)
    queries = [torch.randn(4, H, D, generator=gen) for _ in raw]
    policy = make_policy("snapkv", budget=BS, window_size=4, kernel_size=1)
    key = ChunkKey(b"\0" * 32)

    def job(pages_: list[torch.Tensor]) -> SaveJob:
        positions = torch.arange(4 * BS - 4, 4 * BS)
        return SaveJob("r", [key], 0, 4 * BS, pages_, queries, positions, scale=1.0)

    ((_, stored),) = compact_job(job(raw), layout, policy, 4 * BS, BS, fp8=pages)
    ((_, reference),) = compact_job(job(decoded), layout, policy, 4 * BS, BS)
    assert stored.keys.dtype == torch.uint8
    assert torch.equal(stored.positions, reference.positions)
    decoded_rows = stored.keys.view(element).float()
    layer_of_row = torch.arange(stored.keys.shape[0]) // (H * BS)
    scales = torch.tensor(SCALES)[layer_of_row][:, None]
    assert torch.equal(decoded_rows * scales, reference.keys)

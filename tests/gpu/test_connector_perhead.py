"""The connector's CUDA paths against their torch references (skipped without CUDA).

* ``observe_layer`` takes the Triton window-score kernel on CUDA (bf16 / fp16 cache): its
  mass must match the float32 reference on the same keys and queries.
* ``PerHeadAttention`` on vLLM 0.26's token-major pages reads them in place through the
  Triton paged kernel (rows picked on the host, or found by the kernel from device tables):
  its rows must match ``masked_decode_attention`` (torch reference).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmcompact.attention.scores import window_scores
from lmcompact.compaction.holes import Hole, skip_holes
from lmcompact.compaction.page_layout import make_layout
from lmcompact.compaction.per_head import masked_decode_attention
from lmcompact.compaction.per_head_attention import PerHeadAttention
from lmcompact.compaction.save_job import observe_layer
from lmcompact.policies import Need
from tests.gpu.errors import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hkv", "group"), [(3, 3), (8, 4)])
def test_observe_layer_kernel_matches_reference(dtype: torch.dtype, hkv: int, group: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, w, d = 3000, 32, 64
    keys = torch.randn(hkv, t, d, device="cuda", generator=gen).to(dtype).float()
    queries = torch.randn(w, hkv * group, d, device="cuda", generator=gen).to(dtype).float()
    positions = torch.arange(t - w, t)
    mass, rows = observe_layer(
        keys, keys, queries.cpu(), positions, 0, Need.WINDOW_SCORES, d**-0.5, dtype
    )
    assert rows is None and mass is not None and mass.shape == (hkv, t)
    want, _ = window_scores(
        queries.permute(1, 0, 2)[None], keys[None], query_positions=positions.cuda()
    )
    assert rel_err(mass, want[0]) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_place", ["host", "tables", "tail_only"])
def test_perhead_recompute_on_token_major_pages_matches_reference(
    dtype: torch.dtype, in_place: str
) -> None:
    """Host-picked rows, the graph-safe launch over device tables the connector uses on
    CUDA (``attend_in_place``), and that launch reading the hole-cut copies while vLLM's
    tables hold only the tails (``cut_to_tails``), against the masked torch reference."""
    bs, h, g, d = 16, 4, 2, 64
    layout = make_layout("token_major", bs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # vLLM 0.26 strides: memory order block -> token -> head -> (K | V)
    raw = torch.randn(40, bs, h, 2 * d, device="cuda", generator=gen).to(dtype)
    kv = raw.permute(0, 2, 1, 3)
    rows = {"a": [3, 9, 1, 14, 6, 2, 11], "c": [10, 12, 13, 15, 16, 17, 18, 19]}
    holes = {3: Hole(3, 2, 3), 10: Hole(10, 2, 4)}
    logical = {"a": 7 * bs - 2, "c": 8 * bs - 1}
    counts = {
        "a": torch.tensor([[5, 32, 0, 17]]),
        "c": torch.tensor([[32, 3, 1, 20]]),
    }
    perhead = PerHeadAttention(layout, {"l0": kv}, {"l0": 0}, {"l0": d**-0.5}, d)
    if in_place != "host":
        perhead.attend_in_place(capacity=4, max_keys=8 * bs)
        perhead.tail_only = in_place == "tail_only"
    for rid in rows:
        perhead.add(rid, rows[rid][0], counts[rid], 2 * bs)
    perhead.begin_step(holes, forgotten=[])
    table = torch.zeros(2, 8, dtype=torch.int32)
    for i, row in enumerate(rows.values()):
        table[i, : len(row)] = torch.tensor(row)
    lens = torch.tensor(list(logical.values()), dtype=torch.int32)
    edited = skip_holes(table, lens, 2, holes, bs)
    assert edited is not None
    metadata = SimpleNamespace(
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32, device="cuda"),
        block_table=edited[0].cuda(),
        seq_lens=edited[1].cuda(),
        max_query_len=3,
    )
    if perhead.tail_only:
        cut = perhead.cut_to_tails(
            list(rows), metadata.block_table, metadata.seq_lens, holes, metadata.query_start_loc
        )
        assert cut == {0: 2 * bs, 1: 2 * bs}
        # a: 1 query, c: 3; both rows keep only the block of their first query
        assert metadata.block_table[:, 0].tolist() == [rows["a"][6], rows["c"][7]]
        assert metadata.seq_lens.tolist() == [bs - 2, bs - 1]
    query = torch.randn(4, h * g * d, device="cuda", generator=gen).to(dtype)
    output = torch.zeros(4, h * g * d, device="cuda", dtype=dtype)
    perhead("l0", query, metadata, output)
    for rid, span in (("a", slice(0, 1)), ("c", slice(1, 4))):
        hole = holes[rows[rid][0]]
        want = masked_decode_attention(
            query[span].view(-1, h * g, d),
            kv,
            layout,
            rows[rid],
            counts[rid][0],
            (hole.start_block + hole.num_blocks) * bs,
            logical[rid],
            d**-0.5,
            reserved=2 * bs,
        )
        assert rel_err(output[span].view(-1, h * g, d), want) < 2e-2
    assert math.isfinite(float(output.float().abs().sum()))

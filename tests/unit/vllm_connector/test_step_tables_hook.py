"""The full-graph hole cut's key-length handling (``connectors.vllm.patches.runner``).

The GPU test ``tests/gpu/test_serve_graphs.py`` runs it inside vLLM 0.26; here its contract
runs on the CPU with a stand-in batch: attention reads a cut copy in a fixed buffer, while the
runner's own key lengths (read by vLLM's sampler) and upper bounds stay logical.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from connectors.vllm.patches import runner
from lmcompact.compaction.holes import cut_holes_in_place

BS = 4


class CuttingEditor:
    def __init__(self) -> None:
        self.calls = 0

    def edit_tables(
        self,
        req_ids: list[str],
        block_tables: tuple[torch.Tensor, ...],
        seq_lens: torch.Tensor,
        seq_lens_upper: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        self.calls += 1
        row = req_ids.index("b")
        cut_holes_in_place(block_tables[0], seq_lens, [row], [1], [2], BS)
        upper = seq_lens_upper.clone()
        upper[row] -= 2 * BS
        return upper


def batch() -> Any:
    runner_lens = torch.zeros(8, dtype=torch.int32)  # the runner's buffer (max_num_reqs)
    runner_lens[:2] = torch.tensor([5, 5 * BS + 1], dtype=torch.int32)
    return SimpleNamespace(
        req_ids=["a", "b"],
        num_reqs=2,
        seq_lens=runner_lens[:2],
        seq_lens_cpu_upper_bound=torch.tensor([5, 5 * BS + 1], dtype=torch.int32),
    )


@pytest.mark.parametrize("capture", [False, True])
def test_attention_reads_a_cut_copy_and_the_runner_keeps_logical_lengths(
    monkeypatch: pytest.MonkeyPatch, capture: bool
) -> None:
    editor = CuttingEditor()
    monkeypatch.setattr(runner, "_active_editor", lambda: editor)
    state = SimpleNamespace()
    inputs = batch()
    logical = inputs.seq_lens
    upper = inputs.seq_lens_cpu_upper_bound
    tables = (torch.arange(12, dtype=torch.int32).view(2, 6),)
    seen: dict[str, Any] = {}
    with runner._cut_attention_inputs(state, inputs, tables, capture):
        seen["lens"] = inputs.seq_lens.clone()
        seen["ptr"] = inputs.seq_lens.data_ptr()
        seen["max"] = int(inputs.seq_lens_cpu_upper_bound.max())
    assert inputs.seq_lens is logical and inputs.seq_lens_cpu_upper_bound is upper
    assert logical.tolist() == [5, 5 * BS + 1]  # never cut
    assert seen["ptr"] == state._lmcompact_seq_lens.data_ptr() != logical.data_ptr()
    assert state._lmcompact_seq_lens.numel() == 8  # as long as the runner's buffer
    if capture:  # graph capture: same values, no cut
        assert editor.calls == 0 and seen["lens"].tolist() == [5, 5 * BS + 1]
    else:
        assert editor.calls == 1
        assert seen["lens"].tolist() == [5, 3 * BS + 1]
        assert seen["max"] == 3 * BS + 1
        assert tables[0][1].tolist() == [6, 9, 10, 11, 0, 0]


def test_without_an_lmcompact_connector_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "_active_editor", lambda: None)
    state = SimpleNamespace()
    inputs = batch()
    logical = inputs.seq_lens
    with runner._cut_attention_inputs(state, inputs, (torch.zeros(2, 6),), False):
        assert inputs.seq_lens is logical
    assert not hasattr(state, "_lmcompact_seq_lens")

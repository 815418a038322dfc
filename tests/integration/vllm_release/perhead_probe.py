"""Record the connector's per-head recompute and check it against dense attention.

Shared by ``test_per_head.py`` (CPU) and ``scripts/gpu/perhead_check.py`` (GPU): two
worker observers around the connector's recompute keep, per decode call of a per-head
request, vLLM's own rows (which attend to the zero padding), the rows after the
recompute, the queries and a copy of the request's pages; :func:`dense_reference`
computes attention straight from those pages with each head's own count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Call:
    """One recorded attention call of one layer for one per-head request."""

    layer: int
    req_id: str
    queries: torch.Tensor  # (q_len, Hq, D)
    vllm_out: torch.Tensor  # vLLM's own output rows (q_len, Hq, D)
    out: torch.Tensor  # after the connector's recompute (q_len, Hq, D)
    pages: torch.Tensor  # copy of the request's hole-skipped pages
    seq_len: int  # hole-skipped key length
    counts: torch.Tensor  # (Hkv,) kept tokens per kv head
    reserved: int  # tokens reserved for the kept region (the tail starts there)


class PerHeadRecorder:
    """Observers around the recompute (``before`` first, ``after`` last) for some layers.

    Args:
        connector: The worker-side ``LMCompactConnector`` (its ``worker`` and that
            worker's ``perhead``).
        layers: Layer indices to record.
        limit: Stop after this many calls (None: all).
    """

    def __init__(self, connector: Any, layers: list[int], limit: int | None = None) -> None:
        self.worker = connector.worker
        self.perhead = self.worker.perhead
        if self.perhead is None:
            raise ValueError("the connector's worker runs no per-head recompute")
        names = list(self.worker.layers)
        self.names = {names[i]: i for i in layers}
        self.pending: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: list[Call] = []
        self.limit = limit

    def install(self) -> None:
        """Put ``before`` first and ``after`` last among the worker's observers."""
        self.worker.observers.insert(0, self.before)
        self.worker.observers.append(self.after)

    def _full(self) -> bool:
        return self.limit is not None and len(self.calls) >= self.limit

    def rows(self, metadata: Any) -> list[tuple[int, str]]:
        """(batch row, request id) of the per-head requests in this call."""
        firsts = metadata.block_table[: metadata.query_start_loc.numel() - 1, 0].tolist()
        by_first = {e.first_block: r for r, e in self.perhead.entries.items()}
        return [(row, by_first[f]) for row, f in enumerate(firsts) if f in by_first]

    def before(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        if name not in self.names or self._full():
            return
        starts = metadata.query_start_loc.tolist()
        for row, req_id in self.rows(metadata):
            span = slice(starts[row], starts[row + 1])
            self.pending[(name, req_id)] = (query[span].clone(), output[span].clone())

    def after(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        if name not in self.names or self._full():
            return
        starts = metadata.query_start_loc.tolist()
        kv = self.worker.kv_caches[name]
        d, block = self.worker.facts.head_dim, self.worker.facts.block_size
        for row, req_id in self.rows(metadata):
            if (name, req_id) not in self.pending:
                continue
            queries, vllm_out = self.pending.pop((name, req_id))
            entry = self.perhead.entries[req_id]
            seq_len = int(metadata.seq_lens[row])
            blocks = metadata.block_table[row, : -(-seq_len // block)].long()
            q_len = queries.shape[0]
            self.calls.append(
                Call(
                    self.names[name],
                    req_id,
                    queries.view(q_len, -1, d),
                    vllm_out.view(q_len, -1, d),
                    output[starts[row] : starts[row + 1]].clone().view(q_len, -1, d),
                    kv[blocks].clone(),
                    seq_len,
                    entry.counts[self.names[name]].clone(),
                    entry.reserved,
                )
            )


def dense_reference(call: Call, layout: Any, scale: float) -> torch.Tensor:
    """``(q_len, Hq, D)`` float64: each kv head attends to its own ``count`` packed keys
    plus the causal tail, by a dense softmax over keys read through ``layout``."""
    n_blocks = call.pages.shape[0]
    keys, values = layout.read(call.pages, list(range(n_blocks)), 0, call.seq_len)
    q_len, hq, _ = call.queries.shape
    hkv = keys.shape[0]
    group = hq // hkv
    out = torch.zeros(call.queries.shape, dtype=torch.float64, device=call.queries.device)
    for h in range(hkv):
        for i in range(q_len):
            last = call.seq_len - q_len + i + 1
            index = torch.cat(
                [torch.arange(int(call.counts[h])), torch.arange(call.reserved, last)]
            ).to(keys.device)
            k, v = keys[h, index].double(), values[h, index].double()
            q = call.queries[i, h * group : (h + 1) * group].double()
            out[i, h * group : (h + 1) * group] = torch.softmax(q @ k.T * scale, -1) @ v
    return out

"""Look inside a running connector's attention and compare it with float references.

Two worker observers (``worker.observers``: ``observer(layer_name, query, attn_metadata,
output)`` after every patched attention call) and the references they are checked against:

* :class:`PrefillRecorder` keeps the query, output, block row and key length of the
  prefill calls of some layers, and the K/V the kernel read; :func:`compacted_prefix`
  reads the kept K/V of stored chunks, and :func:`attention_vs_reference` computes
  ``ragged_attention`` of the recorded queries over that prefix plus the tail (the CPU
  integration tests and ``scripts/gpu/connector_roundtrip.py``).
* :class:`PerHeadRecorder` wraps the worker's per-head recompute (the release group's
  ``per_head`` counts): per decode call of a per-head request, vLLM's own rows (which attend
  to the zero padding), the rows after the recompute, the queries and a copy of the
  request's pages; :func:`dense_reference` computes attention straight from those pages
  with each head's own count (the CPU integration tests and ``scripts/gpu/perhead_check.py``).

The worker is the connector's worker role (``connector.worker``); its attention metadata is
the engine's (``block_table``, ``seq_lens``, ``query_start_loc``, ``num_actual_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.compaction.per_head import dense_rows

Prefix = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""Per kv head: ``(keys (n, D), values (n, D), original positions (n,))`` of a prefix."""


class PrefillRecorder:
    """Worker observer of some layers: query, output, block row and key length of each
    prefill call (calls of two tokens or more), optionally the K/V the kernel read.

    Attributes:
        calls: Per layer name, one dict per call: ``query`` ``(n, Hq * D)``, ``output``
            ``(n, Hq * D)``, ``block_row`` (the first request's blocks), ``seq_len`` (its
            key length, hole skipped), and with a worker ``keys`` / ``values``
            ``(Hkv, seq_len, D)`` float32 on the CPU plus the ``metadata`` class name.
    """

    def __init__(self, names: list[str], worker: Any | None = None) -> None:
        """``worker``: the connector's worker whose pages to read K/V from (None: no K/V)."""
        self.worker = worker
        self.calls: dict[str, list[dict[str, Any]]] = {name: [] for name in names}

    def __call__(self, name: str, query: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        if name not in self.calls or metadata.num_actual_tokens < 2:
            return
        n = int(metadata.num_actual_tokens)
        call: dict[str, Any] = {
            "query": query[:n].detach().clone(),
            "output": output[:n].detach().clone(),
            "block_row": metadata.block_table[0].tolist(),
            "seq_len": int(metadata.seq_lens[0]),
        }
        if self.worker is not None:
            keys, values = self.worker.layout.read(
                self.worker.kv_caches[name], call["block_row"], 0, call["seq_len"]
            )
            call.update(
                query=call["query"].float().cpu(),
                output=call["output"].float().cpu(),
                keys=keys.float().cpu(),  # as the kernel sees them (hole already skipped)
                values=values.float().cpu(),
                metadata=type(metadata).__name__,
            )
        self.calls[name].append(call)


def stored_chunks(connector: Any, prompt: list[int], chunk_size: int | None = None) -> list[Any]:
    """The stored chunks of ``prompt`` in the connector's store: its rank's slices (None
    where a chunk is missing); ``chunk_size`` defaults to the connector's."""
    from lmcompact.store import ChunkKeyer

    spec = connector.spec
    keyer = ChunkKeyer(spec.namespaces[0], chunk_size or spec.config.store.chunk_size)
    keys = [key.for_rank(connector.tp_rank, spec.facts.tp_size) for key in keyer.keys(prompt)]
    return list(connector.store.get_many(keys))


def compacted_prefix(chunks: list[Any], layer: int, heads: int, chunk_size: int) -> Prefix:
    """Per kv head, the kept K/V (float32) and original positions of stored ``chunks``."""
    out: Prefix = []
    for h in range(heads):
        parts = [c.head(layer, h) for c in chunks]
        out.append(
            (
                torch.cat([p[0].float() for p in parts]),
                torch.cat([p[1].float() for p in parts]),
                torch.cat([p[2].long() + i * chunk_size for i, p in enumerate(parts)]),
            )
        )
    return out


def attention_vs_reference(
    call: dict[str, Any],
    prefix: Prefix,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    n_prefix: int,
    total: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine output, reference output), both ``(1, Hq, tail, D)``: the reference is
    ``ragged_attention`` of the call's tail queries over ``prefix[h]`` plus the tail's
    K/V ``tail_k`` / ``tail_v`` ``(Hkv, tail, D)`` at positions ``n_prefix .. total``."""
    from lmcompact.attention.reference import ragged_attention
    from lmcompact.layout.ragged import RaggedLayer

    tail = total - n_prefix
    heads = len(prefix)
    keys, values, positions, counts = [], [], [], []
    for h in range(heads):
        pk, pv, pp = prefix[h]
        keys.append(torch.cat([pk, tail_k[h].to(pk.dtype)]))
        values.append(torch.cat([pv, tail_v[h].to(pv.dtype)]))
        positions.append(torch.cat([pp, torch.arange(n_prefix, total)]))
        counts.append(keys[-1].shape[0])
    cu = torch.zeros(heads + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(counts), 0)
    ragged = RaggedLayer(torch.cat(keys), torch.cat(values), torch.cat(positions), cu, heads)
    query = call["query"].view(tail, -1, head_dim).permute(1, 0, 2).unsqueeze(0)
    expected, _ = ragged_attention(
        query.to(keys[0].dtype), ragged, torch.arange(n_prefix, total)[None]
    )
    got = call["output"].view(tail, -1, head_dim).permute(1, 0, 2).unsqueeze(0)
    return got, expected


@dataclass
class PerHeadCall:
    """One recorded attention call of one layer for one per-head request."""

    layer: int
    req_id: str
    queries: torch.Tensor  # (q_len, Hq, D)
    vllm_out: torch.Tensor  # the engine's own output rows (q_len, Hq, D)
    out: torch.Tensor  # after the connector's recompute (q_len, Hq, D)
    pages: torch.Tensor  # copy of the request's hole-skipped pages
    seq_len: int  # hole-skipped key length
    counts: torch.Tensor  # (Hkv,) kept tokens per kv head
    reserved: int  # tokens reserved for the kept region (the tail starts there)


class PerHeadRecorder:
    """Observers around the per-head recompute (``before`` first, ``after`` last) for some
    layers.

    Args:
        worker: The connector's worker (``connector.worker``), its per-head recompute on
            (``worker.perhead``: the release group's ``per_head`` counts).
        layers: Layer indices to record.
        limit: Stop after this many calls (None: all).
    """

    def __init__(self, worker: Any, layers: list[int], limit: int | None = None) -> None:
        self.worker = worker
        self.perhead = worker.perhead
        names = list(worker.layers)
        self.names = {names[i]: i for i in layers}
        self.pending: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: list[PerHeadCall] = []
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
                PerHeadCall(
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


def dense_reference(call: PerHeadCall, layout: Any, scale: float) -> torch.Tensor:
    """``(q_len, Hq, D)`` float64: each kv head attends to its own ``count`` kept keys (read
    back from the request's dense cells) plus the causal tail, by a dense softmax."""
    n_blocks = call.pages.shape[0]
    keys, values = layout.read(call.pages, list(range(n_blocks)), 0, call.seq_len)
    bs = layout.block_size
    kept_k = dense_rows(keys[:, : call.reserved], call.counts, bs)
    kept_v = dense_rows(values[:, : call.reserved], call.counts, bs)
    q_len, hq, _ = call.queries.shape
    hkv = keys.shape[0]
    group = hq // hkv
    out = torch.zeros(call.queries.shape, dtype=torch.float64, device=call.queries.device)
    for h in range(hkv):
        for i in range(q_len):
            last = call.seq_len - q_len + i + 1
            k = torch.cat([kept_k[h], keys[h, call.reserved : last]]).double()
            v = torch.cat([kept_v[h], values[h, call.reserved : last]]).double()
            q = call.queries[i, h * group : (h + 1) * group].double()
            out[i, h * group : (h + 1) * group] = torch.softmax(q @ k.T * scale, -1) @ v
    return out

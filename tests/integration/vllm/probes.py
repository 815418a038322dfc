"""Look inside a running connector: prefill attention calls, stored chunks, the reference.

Shared by the CPU integration tests (``test_connector_tiny.py``) and the GPU check script
``scripts/gpu/connector_roundtrip.py``: one recorder of what a layer's attention saw and
one float32 reference (``ragged_attention``) over a compacted prefix plus the tail.
"""

from __future__ import annotations

from typing import Any

import torch

Prefix = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""Per kv head: ``(keys (n, D), values (n, D), original positions (n,))`` of a prefix."""


class PrefillRecorder:
    """Worker observer of some layers: query, output, block row and key length of each
    prefill call (calls of two tokens or more), optionally the K/V the kernel read.

    Attributes:
        calls: Per layer name, one dict per call: ``query`` ``(n, Hq * D)``, ``output``
            ``(n, Hq * D)``, ``block_row`` (the first request's blocks), ``seq_len`` (its
            key length, hole skipped), and with ``read_kv`` ``keys`` / ``values``
            ``(Hkv, seq_len, D)`` float32 on the CPU plus the ``metadata`` class name.
    """

    def __init__(self, names: list[str], half: Any | None = None) -> None:
        """``half``: the connector's :class:`~connectors.vllm.worker.Worker` whose pages to
        read K/V from (None: no K/V)."""
        self.half = half
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
        if self.half is not None:
            keys, values = self.half.layout.read(
                self.half.kv_caches[name], call["block_row"], 0, call["seq_len"]
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
    """The stored chunks of ``prompt`` in ``connector``'s store (an ``LMCompactConnector``;
    its rank's namespace), None where a chunk is missing."""
    from lmcompact.store import ChunkKeyer

    spec = connector.spec
    namespace = spec.namespaces[connector.tp_rank]
    keyer = ChunkKeyer(namespace, chunk_size or spec.config.store.chunk_size)
    return connector.store.get_many(keyer.keys(prompt))


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

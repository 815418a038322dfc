"""Per-head stored counts (``store.per_head``) through the real vLLM CPU engine.

One float32 engine with the store connector (kvzip with ``allocation: "ragged"``, Ada-KV or
PyramidKV; budget 0.25, chunks of 256, blocks of 32, per-head cap ``2 x 64 = 128`` rows per
chunk, each layer's heads at most ``64 x H`` rows together: layer slack 1) serves one prompt
twice: the first request computes it and saves 4 compacted chunks whose (layer, head) counts
differ; the second loads them (each layer's heads as dense cells of 4 x 64 slots, the blocks
one count would take, a hole for the rest) and computes the tail.

The loaded request's greedy tokens and log-probabilities must equal those of transformers
running the same weights with a mask that keeps exactly each head's stored tokens
(:mod:`tests.integration.vllm_sliding.reference`). vLLM's own attention reads the cells
as if every head's slots were its own tokens, so without the connector's per-head recompute
the comparison fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import release_engine
from tests.integration.vllm_sliding import reference

pytestmark = pytest.mark.integration

CHUNK = 256
KEPT = 64  # budget 0.25 of a chunk
HEAD_CAP = 128  # slack 2
NEW_TOKENS = 8
PROMPT = tiny_prompt_ids(1100, seed=31)  # 4 chunks stored, 76 tokens computed after a load
EXTRA = {
    "policy": "kvzip",
    "policy_params": {"allocation": "ragged", "share": False},
    "budget": 0.25,
    "window": 16,
    "store": {"chunk_size": CHUNK, "async_save": False, "per_head": {"slack": 2}},
}
POLICIES = {
    "kvzip": EXTRA,  # the cap-aware global top-k: the budget on average exactly
    "adakv": {**EXTRA, "policy": "adakv", "policy_params": {}},  # its own counts, clipped
    # one count per layer, more in lower layers: cut to the layer's cells there
    "pyramidkv": {**EXTRA, "policy": "pyramidkv", "policy_params": {}},
    # a layer's heads share floor(64 x 1.2) = 76 rows of a chunk: the load of 4 chunks
    # takes 304 cells per head, rounded up once to 10 blocks (not 3 blocks per chunk)
    "kvzip_layer_slack": {
        **EXTRA,
        "store": {**EXTRA["store"], "per_head": {"slack": 2, "layer_slack": 1.2}},
    },
}
LAYER_ROWS = {"kvzip_layer_slack": 76}  # else KEPT
LOAD_WIDTH = {"kvzip_layer_slack": 320}  # else 4 x KEPT
LOGPROB_ATOL = 1e-5  # the bound (float32; measured 0.5-1.4e-6)
CONNECTOR = ("LMCompactConnector", "connectors.vllm.connector")  # the store path alone


def _generate(llm: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    return reference.engine_greedy(llm, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module", params=sorted(POLICIES))
def served(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from connectors.vllm.worker import Worker
    from lmcompact.compaction.per_head_attention import PerHeadAttention

    loads: list[tuple[Any, list[Any]]] = []
    widths: list[int] = []
    fetch = Worker._fetch
    add = PerHeadAttention.add

    def recording_add(self: PerHeadAttention, *args: Any, **kwargs: Any) -> None:
        widths.append(int(args[3]) - int(kwargs.get("base", 0)))  # reserved - base
        add(self, *args, **kwargs)

    def recording_fetch(self: Worker, spec: Any) -> Any:
        chunks = fetch(self, spec)
        if chunks is not None:
            loads.append((spec, [chunk.clone() for chunk in chunks]))
        return chunks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Worker, "_fetch", recording_fetch)
        patch.setattr(PerHeadAttention, "add", recording_add)
        extra = POLICIES[request.param]
        with release_engine(str(tiny_model), extra, max_model_len=2048, connector=CONNECTOR) as llm:
            first = _generate(llm, PROMPT)  # computed, 4 chunks saved
            second = _generate(llm, PROMPT)  # loaded from the store
            connector = get_kv_transfer_group()
            stats = dict(connector.worker.perhead.stats)
            worker = dict(connector.worker.stats)
    yield {
        "policy": request.param,
        "first": first,
        "second": second,
        "loads": loads,
        "widths": widths,
        "stats": stats,
        "worker": worker,
    }


def test_stored_counts_are_ragged_and_capped(served: dict[str, Any]) -> None:
    assert len(served["loads"]) == 1, "the second request must load the stored chunks"
    spec, chunks = served["loads"][0]
    assert spec.start == 0 and len(chunks) == len(PROMPT) // CHUNK
    for chunk in chunks:
        counts = chunk.kept_counts
        assert counts.unique().numel() > 1  # the policy's own counts, kept as chosen
        assert int(counts.max()) <= HEAD_CAP
        if served["policy"] != "pyramidkv":  # heads of one layer differ: some keep more
            assert int(counts.max()) > KEPT
        # each layer fits the cells of its rows x H heads (at layer slack 1 the blocks a
        # uniform count holds); kvzip's capped global top-k fills them exactly there,
        # Ada-KV's clipped counts may not
        layer_sums = counts.sum(dim=1)
        assert int(layer_sums.max()) <= LAYER_ROWS.get(served["policy"], KEPT) * counts.shape[1]
        if served["policy"] == "kvzip_layer_slack":
            assert int(layer_sums.max()) > KEPT * counts.shape[1]  # the slack is used
        if served["policy"] == "kvzip":
            assert layer_sums.tolist() == [KEPT * counts.shape[1]] * counts.shape[0]
    assert served["worker"]["loaded_chunks"] == len(chunks)
    # the load's cells: n x rows slots, rounded up to whole blocks once
    assert served["widths"] == [LOAD_WIDTH.get(served["policy"], len(chunks) * KEPT)]
    # the recompute ran for the loaded request (prefill tail and every decode step)
    assert served["stats"]["requests"] == 1 and served["stats"]["calls"] >= NEW_TOKENS


def test_store_load_equals_masked_reference(tiny_model: Path, served: dict[str, Any]) -> None:
    _, chunks = served["loads"][0]
    n = len(chunks)
    model = reference.load(str(tiny_model))
    kept = reference.stored_positions(chunks, CHUNK)
    compaction = reference.Compaction(span=n * CHUNK, from_query=n * CHUNK, kept=kept)
    reference.assert_engine_matches(model, PROMPT, served["second"], compaction, LOGPROB_ATOL)


def test_vllm_prefix_cache_hits_are_served_by_vllm_not_the_store(tiny_model: Path) -> None:
    """With vLLM's prefix caching on, a repeat finds the full KV in vLLM's own cache first;
    a per-head load could not pack behind it, so the connector loads nothing and the repeat
    gives the first request's tokens (the full prompt's answer)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    with release_engine(
        str(tiny_model), EXTRA, max_model_len=2048, connector=CONNECTOR, prefix_caching=True
    ) as llm:
        first = _generate(llm, PROMPT)
        second = _generate(llm, PROMPT)
        stats = dict(get_kv_transfer_group().worker.stats)
    assert stats["saved_chunks"] == len(PROMPT) // CHUNK and stats["loads"] == 0
    assert second[0] == first[0]

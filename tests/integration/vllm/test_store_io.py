"""Store I/O belongs to the worker: the scheduler only asks whether chunks exist (issue 14).

Real in-process vLLM (CPU) with a random-weight tiny Llama. Checked:
- the connector metadata never carries a tensor (keys and block ids only);
- a prompt repeated while its first request's save is still running waits for that save
  (vLLM asks the connector again) and is then served from the store, fetched once;
- the repeated lookups of the waiting request query the store at most once per change.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm.engine import engine, greedy, worker_connector
from tests.integration.vllm.tensor_walk import tensors_in
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids

pytestmark = pytest.mark.integration

CHUNK = 64
PROMPT = tiny_prompt_ids(300, seed=5)  # 4 chunks stored, 44 tokens computed
SAVE_DELAY_S = 3.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def test_tensor_finder_finds_a_tensor() -> None:
    """The walker used below can fail: a tensor two levels down is found."""

    @dataclasses.dataclass
    class Inner:
        rows: list[Any]

    assert list(tensors_in({"a": Inner([1, torch.zeros(2)])})) == ["Tensor"]


def test_repeat_waits_for_the_save_then_loads_once_without_kv_in_metadata(
    tiny_model: str,
) -> None:
    extra = {"policy": "snapkv", "budget": 0.5, "store": {"chunk_size": CHUNK}, "window": 16}
    with engine(tiny_model, extra) as llm:
        from tests.integration.vllm_release.harness import scheduler

        sched = scheduler(llm)
        sched_half = sched.connector.scheduler
        worker = worker_connector()
        store = worker.store
        metas: list[Any] = []
        build = sched.connector.build_connector_meta

        def build_and_keep(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            metas.append(meta)
            return meta

        sched.connector.build_connector_meta = build_and_keep

        put_many, get_many = store.put_many, store.get_many
        fetched: list[int] = []
        saving = threading.Event()

        def slow_put_many(items: Any) -> Any:
            saving.set()
            time.sleep(SAVE_DELAY_S)  # a save still running when the repeat arrives
            return put_many(items)

        def counted_get_many(keys: Any, *args: Any) -> Any:
            fetched.append(len(keys))
            return get_many(keys, *args)

        store.put_many = slow_put_many
        store.get_many = counted_get_many

        first = greedy(llm, PROMPT, 8)
        # the save runs on the worker's thread (compaction, then the slow put): the repeat
        # below is submitted while it is in flight; `waits` shows it saw that
        assert sched_half.stats["hit_chunks"] == 0
        began = time.monotonic()
        second = greedy(llm, PROMPT, 8)  # submitted while the save sleeps
        waited = time.monotonic() - began
        worker.worker.drain()

    n_chunks = len(PROMPT) // CHUNK
    assert saving.is_set()
    assert sched_half.stats["waits"] >= 1, sched_half.stats
    assert sched_half.stats["hit_chunks"] == n_chunks
    assert fetched == [n_chunks]  # one fetch, by the worker, for the one load
    # the waiting request's repeated lookups did not query the store each time
    assert sched_half.stats["store_queries"] < sched_half.stats["lookups"], sched_half.stats
    assert worker.worker.stats["loaded_chunks"] == n_chunks
    assert waited < SAVE_DELAY_S + 30
    loads = [load for meta in metas for load in meta.step.loads]
    assert len(loads) == 1 and len(loads[0].keys) == n_chunks
    found = [path for meta in metas for path in tensors_in(meta)]
    assert not found, found
    assert len(first) == len(second) == 8


def test_no_wait_without_a_save_in_flight(tiny_model: Path) -> None:
    """A prompt nobody is saving is not held back: it misses at once."""
    extra = {"policy": "none", "store": {"chunk_size": CHUNK, "save": False}}
    with engine(str(tiny_model), extra) as llm:
        from tests.integration.vllm_release.harness import scheduler

        half = scheduler(llm).connector.scheduler
        greedy(llm, PROMPT, 2)
        greedy(llm, PROMPT, 2)
    assert half.stats["waits"] == 0 and half.stats["hit_chunks"] == 0


def test_saves_past_the_backlog_limit_are_skipped_and_recomputed(tiny_model: str) -> None:
    """With the background thread busy, page copies pile up to ``max_pending_save_mb``;
    saves past it are skipped (counted, reported unsaved), and a repeat of a skipped prompt
    is recomputed (its first answer), never left waiting for a save that will not come."""
    prompts = [tiny_prompt_ids(300, seed=s) for s in (11, 12, 13)]
    store = {"chunk_size": CHUNK, "max_pending_save_mb": 1}
    extra = {"policy": "snapkv", "budget": 0.5, "window": 16, "store": store}
    with engine(tiny_model, extra) as llm:
        from vllm import SamplingParams

        half = worker_connector().worker
        page_bytes = sum(kv[0].nbytes for kv in half.kv_caches.values())
        assert 300 * page_bytes // half.facts.block_size > (1 << 20) // 2  # two do not fit
        gate = threading.Event()
        half._executor.submit(gate.wait)  # the save thread is busy: copies queue up
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        first = [list(o.outputs[0].token_ids) for o in outs]
        gate.set()
        half.drain()
        skipped = int(half.stats["saves_skipped"])
        assert skipped >= 1 and int(half.stats["saves"]) + skipped == len(prompts), half.stats
        second = [greedy(llm, p, 8) for p in prompts]
        loaded = int(half.stats["loaded_chunks"])
    n_chunks = len(prompts[0]) // CHUNK
    # the saved prompts load their chunks; the skipped ones recompute their first answer
    assert loaded == (len(prompts) - skipped) * n_chunks, half.stats
    recomputed = [a == b for a, b in zip(first, second, strict=True)]
    assert sum(recomputed) >= skipped

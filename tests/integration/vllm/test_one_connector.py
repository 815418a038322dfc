"""One connector, option groups in any combination, old spellings still loading (real vLLM
CPU engine, tiny random-weight Llama).

* ``store`` and ``release`` together on ``LMCompactConnector``: the first request is packed
  in place (its hole blocks go back to the pool) and its prefix stored; the repeat loads
  the stored chunks.
* ``release`` alone, spelled new (``LMCompactConnector`` at ``lmcompact.vllm.connector``,
  ``"store": false``, ``"release"``) and old (``LMCompactMemoryConnector`` at
  ``connectors.memory.connector``, flat ``save``/``load``, ``"memory"``): the same class
  runs, the same packs happen, and the greedy tokens are identical.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.vllm.engine import greedy, worker_connector
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_memory.harness import memory_engine, scheduler

pytestmark = pytest.mark.integration

CHUNK = 64
PROMPT = tiny_prompt_ids(300, seed=5)  # 4 full chunks + a 44-token tail; 9 full blocks
POLICY = {"policy": "snapkv", "budget": 0.5, "window": 8}
NEW = ("LMCompactConnector", "lmcompact.vllm.connector")
OLD = ("LMCompactMemoryConnector", "connectors.memory.connector")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def test_store_and_release_in_one_connector(tiny_model: str) -> None:
    extra = {
        **POLICY,
        "store": {"chunk_size": CHUNK, "async_save": False},
        "release": {"prefill": "pack"},
    }
    with memory_engine(tiny_model, extra, connector=NEW) as llm:
        greedy(llm, PROMPT, max_tokens=4)
        worker: Any = worker_connector()
        sched: Any = scheduler(llm).connector
        assert type(worker).__name__ == "LMCompactConnector"
        memory = sched.memory_scheduler
        assert memory is not None and memory.stats.packs == 1
        assert memory.stats.blocks_released > 0  # the pack's hole went back to the pool
        assert worker.pack_stats["packs"] == 1 and worker.pack_stats["unscored"] == 0
        assert worker.worker_half.stats["saved_chunks"] == len(PROMPT) // CHUNK
        greedy(llm, PROMPT, max_tokens=4)
        assert worker.worker_half.stats["loaded_chunks"] == len(PROMPT) // CHUNK


def _release_only(model: str, extra: dict[str, Any], connector: tuple[str, str]) -> Any:
    with memory_engine(model, extra, connector=connector) as llm:
        tokens = greedy(llm, PROMPT, max_tokens=8)
        sched: Any = scheduler(llm).connector
        worker: Any = worker_connector()
        return (
            tokens,
            type(sched).__module__,
            sched.memory_scheduler.stats.packs,
            sched.memory_scheduler.stats.blocks_released,
            worker.worker_half.stats["saved_chunks"],
        )


def test_release_only_new_and_old_spellings_agree(tiny_model: str) -> None:
    new = _release_only(tiny_model, {**POLICY, "store": False, "release": {"prefill": "pack"}}, NEW)
    old = _release_only(
        tiny_model,
        {**POLICY, "save": False, "load": False, "memory": {"prefill": "pack"}},
        OLD,
    )
    assert new[1] == old[1] == "lmcompact.vllm.connector"  # the old path is the same module
    assert new[2] == old[2] == 1 and new[3] == old[3] > 0  # one pack, same blocks released
    assert new[4] == old[4] == 0  # store off: nothing saved
    assert new[0] == old[0]  # the same compacted run, token for token

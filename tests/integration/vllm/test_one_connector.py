"""One connector, option groups in any combination; the old spellings refused (real vLLM CPU
engine, tiny random-weight Llama).

* ``store`` and ``release`` together on ``LMCompactConnector``: the first request is packed
  in place (its hole blocks go back to the pool) and its prefix stored; the repeat loads
  the stored chunks.
* ``release`` alone (``"store": false``) runs the same packs as ``store`` and ``release``
  together: one pack, the same blocks released, the same greedy tokens; nothing is saved.
* The old spellings (``LMCompactMemoryConnector``, the ``"memory"`` group, store options at
  the top level) are gone: they are refused before vLLM starts, naming the new spelling.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.vllm.engine import greedy, transfer_config, worker_connector
from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import release_engine, scheduler

pytestmark = pytest.mark.integration

CHUNK = 64
PROMPT = tiny_prompt_ids(300, seed=5)  # 4 full chunks + a 44-token tail; 9 full blocks
POLICY = {"policy": "snapkv", "budget": 0.5, "window": 8}
CONNECTOR = ("LMCompactConnector", "connectors.vllm.connector")
STORE = {"chunk_size": CHUNK, "async_save": False}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def test_store_and_release_in_one_connector(tiny_model: str) -> None:
    extra = {**POLICY, "store": STORE, "release": {"prefill": "pack"}}
    with release_engine(tiny_model, extra, connector=CONNECTOR) as llm:
        greedy(llm, PROMPT, max_tokens=4)
        worker: Any = worker_connector()
        sched: Any = scheduler(llm).connector
        assert type(worker).__name__ == "LMCompactConnector"
        release = sched.scheduler.release_stats
        assert release.packs == 1
        assert release.blocks_released > 0  # the pack's hole went back to the pool
        assert worker.worker.pack_stats["packs"] == 1
        assert worker.worker.pack_stats["unscored"] == 0
        assert worker.worker.stats["saved_chunks"] == len(PROMPT) // CHUNK
        greedy(llm, PROMPT, max_tokens=4)
        assert worker.worker.stats["loaded_chunks"] == len(PROMPT) // CHUNK


def _first_request(model: str, extra: dict[str, Any]) -> Any:
    with release_engine(model, extra, connector=CONNECTOR) as llm:
        tokens = greedy(llm, PROMPT, max_tokens=8)
        sched: Any = scheduler(llm).connector
        worker: Any = worker_connector()
        worker.worker.drain()
        return (
            tokens,
            type(sched).__module__,
            sched.scheduler.release_stats.packs,
            sched.scheduler.release_stats.blocks_released,
            worker.worker.stats["saved_chunks"],
        )


def test_release_alone_packs_as_with_the_store(tiny_model: str) -> None:
    alone = _first_request(tiny_model, {**POLICY, "store": False, "release": {"prefill": "pack"}})
    both = _first_request(tiny_model, {**POLICY, "store": STORE, "release": {"prefill": "pack"}})
    assert alone[1] == both[1] == "connectors.vllm.connector"
    assert alone[2] == both[2] == 1 and alone[3] == both[3] > 0  # one pack, same blocks
    assert alone[4] == 0  # store off: nothing saved
    assert both[4] == len(PROMPT) // CHUNK
    assert alone[0] == both[0]  # the same compacted run, token for token


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({**POLICY, "memory": {"prefill": "pack"}}, r'"memory" is now the "release" group'),
        ({**POLICY, "save": False, "load": False}, r"store options: give them inside"),
        ({**POLICY, "chunk_size": CHUNK}, r"\['chunk_size'\] are store options"),
    ],
    ids=["memory-group", "flat-save-load", "flat-chunk-size"],
)
def test_old_option_spellings_are_refused(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        transfer_config(extra)


def test_old_connector_name_is_gone() -> None:
    import importlib.util

    import connectors.vllm.connector as module

    assert not hasattr(module, "LMCompactMemoryConnector")
    with pytest.raises(ValueError, match="unknown connector 'LMCompactMemoryConnector'"):
        transfer_config({**POLICY, "release": {}}, "LMCompactMemoryConnector")
    assert importlib.util.find_spec("connectors.memory") is None  # no alias package

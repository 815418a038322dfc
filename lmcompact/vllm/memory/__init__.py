"""The ``"release"`` option group: dropped tokens' KV blocks go back to vLLM's block pool.

* :mod:`~lmcompact.vllm.memory.planner`: where a request's block-aligned hole lies (engine-free);
* :mod:`~lmcompact.vllm.memory.blocks`: returns hole blocks to vLLM's pool, audits the pool;
* :mod:`~lmcompact.vllm.memory.packing`: packs a fresh prefill's kept tokens into its first blocks;
* :mod:`~lmcompact.vllm.memory.scheduler_side`: the per-step plan, hooked into the KV cache
  manager (its parts: :mod:`~lmcompact.vllm.memory.admission`, admission without thrash;
  :mod:`~lmcompact.vllm.memory.scheduler_state`, its jobs, counters and declared state);
* :mod:`~lmcompact.vllm.memory.config`: the group's options;
  :mod:`~lmcompact.vllm.memory.release`: its start-up (hole geometry, refusals);
  :mod:`~lmcompact.vllm.memory.release_worker`: the packs on the worker.

:class:`lmcompact.vllm.connector.LMCompactConnector` composes them when ``"release"`` is given
(``LMCompactMemoryConnector``, its old name, turns it on by default).
"""

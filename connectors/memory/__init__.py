"""The ``"release"`` option group: dropped tokens' KV blocks go back to vLLM's block pool.

* :mod:`~connectors.memory.planner`: where each request's block-aligned hole lies (engine-free);
* :mod:`~connectors.memory.blocks`: returns hole blocks to vLLM's pool, audits the pool;
* :mod:`~connectors.memory.packing`: packs kept tokens of a fresh prefill into its first blocks;
* :mod:`~connectors.memory.scheduler_side`: the per-step plan, hooked into the KV cache manager;
* :mod:`~connectors.memory.config`: the group's options; :mod:`~connectors.memory.release`:
  its start-up (hole geometry, refusals); :mod:`~connectors.memory.release_worker`: the packs;
* :mod:`~connectors.memory.connector`: the old module path of ``LMCompactMemoryConnector``.
"""

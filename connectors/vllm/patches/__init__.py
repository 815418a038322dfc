"""Every place where the connector reaches into vLLM beyond its public connector API.

One module per patch point, each feature-detected and refusing loudly at start-up when what
it needs is missing (the connector names the vLLM version and what to turn off):

* :mod:`~connectors.vllm.patches.attention`: each attention layer's ``forward`` (wrapped per
  instance) and the step's attention metadata (copies that skip holes), per backend;
* :mod:`~connectors.vllm.patches.kv_cache_manager`: the KV-cache manager's allocation hooks,
  the block ledger that gives hole blocks back, the prefix-cache guard, manager discovery;
* :mod:`~connectors.vllm.patches.runner`: the V2 GPU runner's hooks, so holes survive full
  CUDA graphs;
* :mod:`~connectors.vllm.patches.engine`: engine facts (shapes, ranks, layers, RoPE, version)
  and vLLM's process-wide state (logging handlers, the global connector);
* :mod:`~connectors.vllm.patches.scheduler_output`: reading the scheduler output (and its one
  written flag).

Nothing outside this folder imports a vLLM module other than the public connector API
(``tests/unit/core/test_vllm_imports.py`` checks it by reading every module's imports).
"""

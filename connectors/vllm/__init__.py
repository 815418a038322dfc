"""The vLLM v1 KV connector of lmcompact.

Load it with ``"kv_connector": "LMCompactConnector", "kv_connector_module_path":
"connectors.vllm.connector"`` (options: :mod:`connectors.vllm.config`). Importing this
package imports no vLLM; its modules do.

Cut along vLLM's own role split, as vLLM's offloading connector is:

* :mod:`~connectors.vllm.connector`: the facade vLLM instantiates, one-line delegations;
* :mod:`~connectors.vllm.spec`: options + engine facts + the policy + store namespaces,
  built and checked once per process (:mod:`~connectors.vllm.config` parses the options);
* :mod:`~connectors.vllm.scheduler`: the scheduler side, with one record per request
  (:mod:`~connectors.vllm.requests`);
* :mod:`~connectors.vllm.worker`: the worker side, which owns the worker's buffers;
* :mod:`~connectors.vllm.metadata`: the envelopes between them;
* :mod:`~connectors.vllm.patches`: every place that reaches into vLLM beyond its public
  connector API, one file per patch point;
* :mod:`~connectors.vllm.reconstruct`, :mod:`~connectors.vllm.offline`,
  :mod:`~connectors.vllm.launcher`: client helpers, in-process engines, the CLI launcher.
"""

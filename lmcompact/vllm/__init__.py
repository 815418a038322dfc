"""The vLLM v1 KV connector: the only part of lmcompact that imports vLLM.

Load it with ``"kv_connector": "LMCompactConnector", "kv_connector_module_path":
"lmcompact.vllm.connector"`` (:mod:`lmcompact.vllm.connector`; options:
:mod:`lmcompact.vllm.config`). Importing this package imports no vLLM; its modules do.
``connectors`` is its old name, kept as an import alias for one release.
"""

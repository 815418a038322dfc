"""Engine connectors of lmcompact: each one drives an engine with the engine-free core
(:mod:`lmcompact`). :mod:`connectors.vllm` is the vLLM v1 KV connector."""

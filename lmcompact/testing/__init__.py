"""Checking aids shared by the test suite and the device check scripts (``scripts/gpu/``).

:mod:`~lmcompact.testing.tiny_llama` builds small random-weight Llama checkpoints on the
spot (nothing downloaded); :mod:`~lmcompact.testing.attention_probes` records what a running
connector's attention saw and computes float references to compare it with. Engine-free
like the rest of the core: the probes take the connector's objects as arguments and import
neither vLLM nor the connector.
"""

"""transformers integration: model preparation, a compacting ``Cache``, attention hooks.

``lmcompact.hf.prepare`` imports transformers only when it converts a model, so
``from lmcompact.hf.prepare import prepare_model`` is cheap (vLLM users call it).
The cache and attention modules import transformers at module import time.
"""

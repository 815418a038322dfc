"""Quality harness behind ``lmcompact eval``: tasks, text, runner, report, kvpress bridge.

``tasks``, ``text``, ``policies`` and ``report`` are model-free (unit-tested);
``chat_needle`` is the prompt of ``lmcompact demo`` and ``lmcompact bench connector``;
``runner`` loads a real model through ``lmcompact.hf``; ``kvpress_worker`` (the hf
tasks) and ``kvpress_pipeline_worker`` (the vLLM eval's multi_needle / needle cases) run
inside kvpress's own virtual environment, driven by ``kvpress_bridge``; ``kvpress_compare``
puts kvpress's rows beside the vLLM ones.
"""

"""Quality harness behind ``lmcompact eval``: tasks, text, runner, report, kvpress bridge.

``tasks``, ``text``, ``policies`` and ``report`` are model-free (unit-tested);
``runner`` loads a real model through ``lmcompact.hf``; ``kvpress_worker`` runs
inside kvpress's own virtual environment.
"""

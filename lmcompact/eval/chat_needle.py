"""One secret code in a Python-docs haystack, asked for in a chat turn.

The prompt of ``lmcompact demo`` and ``lmcompact bench connector`` (text mode): public-domain
filler (the paragraphs of Python's ``pydoc_data`` topics, shuffled by seed) of about the
requested length, :data:`NEEDLE` at a given depth, and :data:`QUESTION` in the tokenizer's
chat template. An answer is correct when it contains :data:`NEEDLE_VALUE`.
"""

from __future__ import annotations

import random
from typing import Any

NEEDLE_VALUE = "7481"
NEEDLE = f"Remember this: the secret code of the blue door is {NEEDLE_VALUE}. "
QUESTION = "What is the secret code of the blue door? Reply with the number only."


def haystack(tokenizer: Any, context_tokens: int, depth: float, seed: int = 0) -> str:
    """Public-domain filler (Python's own docs) of about ``context_tokens`` with the needle."""
    from pydoc_data.topics import topics

    paragraphs = [" ".join(text.split()) for text in topics.values() if len(text) > 200]
    random.Random(seed).shuffle(paragraphs)
    parts: list[str] = []
    used = 0
    for paragraph in paragraphs:
        sentences = paragraph.split(". ")[:6]
        text = ". ".join(sentences).strip() + ". "
        used += len(tokenizer.encode(text, add_special_tokens=False))
        parts.append(text)
        if used >= context_tokens:
            break
    parts.insert(max(1, int(depth * len(parts))), NEEDLE)
    return "".join(parts)


def build_prompt(tokenizer: Any, context: str) -> list[int]:
    """Token ids of ``context`` and :data:`QUESTION` as a user turn, ready for the answer."""
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]

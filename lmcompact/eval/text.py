"""Public-domain text available offline: Python's own ``pydoc_data`` topics.

``pydoc_data.topics`` ships with every CPython (the language reference, about
465k characters, PSF license), so haystacks and perplexity text need no download
and no extra package. Paragraphs are returned in a fixed order so that a seed
selects the same text on every machine.
"""

from __future__ import annotations

import functools
import random
import re


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """Non-trivial paragraphs of the pydoc topics, sorted by topic then order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # pragma: no cover - stripped Python builds only
        raise RuntimeError(
            "pydoc_data.topics is missing from this Python; install the full standard "
            "library (Debian: libpython3.11-stdlib)"
        ) from error
    out: list[str] = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(block.split())
            if len(text) >= 80:
                out.append(text)
    return tuple(out)


def text_stream(seed: int, skip: int = 0) -> str:
    """A long text: the paragraphs rotated to a seed-chosen start, joined by blank lines.

    Args:
        seed: Chooses the starting paragraph (deterministic).
        skip: Extra paragraphs to skip after the start (separates ppl from haystacks).
    """
    paras = paragraphs()
    start = (random.Random(seed).randrange(len(paras)) + skip) % len(paras)
    return "\n\n".join(paras[start:] + paras[:start])

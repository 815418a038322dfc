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


LICENSES = "/usr/share/common-licenses"
"""Debian's plain-English license texts (GPL, LGPL, GFDL, Apache, ...): a second kind of
natural prose for haystacks, on every Debian and Ubuntu machine (package base-files)."""


@functools.cache
def license_paragraphs(folder: str = LICENSES) -> tuple[str, ...]:
    """Paragraphs of at least 12 words of every file in ``folder``, by file name."""
    from pathlib import Path

    root = Path(folder)
    if not root.is_dir():
        raise RuntimeError(
            f"{folder} is missing (Debian/Ubuntu package base-files has it); use the pydoc "
            "haystack on this machine"
        )
    return tuple(
        " ".join(block.split())
        for path in sorted(p for p in root.iterdir() if p.is_file())
        for block in re.split(r"\n\s*\n", path.read_text(errors="ignore"))
        if len(block.split()) >= 12
    )


def license_stream(seed: int) -> str:
    """The license paragraphs rotated to a ``seed``-chosen start, joined by blank lines."""
    paras = license_paragraphs()
    start = (seed * 7919) % len(paras)
    return "\n\n".join(paras[start:] + paras[:start])


def haystack_text(kind: str, seed: int) -> str:
    """A long natural text of ``kind`` (``"pydoc"`` or ``"licenses"``) for ``seed``."""
    if kind == "pydoc":
        return text_stream(seed)
    if kind == "licenses":
        return license_stream(seed)
    raise ValueError(f"unknown haystack text {kind!r}; allowed: pydoc, licenses")

"""One stored context, several different questions: the multi-query needle setting.

A natural-text haystack (Python's ``pydoc_data`` topics) hides needles at several depths;
the context's token ids are built once and every question is appended to the same ids,
so each question request shares the stored context's chunk prefix exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcompact.eval.tasks import Needle, insert_needles, make_needles, score_needle
from lmcompact.eval.text import text_stream


@dataclass(frozen=True)
class SharedContext:
    """Context ids with needles, and the questions that will reuse it.

    Attributes:
        context: Token ids of the context (what the first request stores).
        needles: The hidden facts, by depth.
        questions: Per needle, the ids appended to ``context`` to ask for it.
    """

    context: list[int]
    needles: tuple[Needle, ...]
    questions: tuple[list[int], ...]

    def prompt(self, index: int) -> list[int]:
        return self.context + self.questions[index]

    def correct(self, index: int, answer: str) -> bool:
        return score_needle(answer, self.needles[index].passkey) == 1.0


def build_shared_context(
    tokenizer: Any,
    context_tokens: int,
    seed: int,
    depths: Sequence[float] = (0.2, 0.5, 0.8),
) -> SharedContext:
    """A context of exactly ``context_tokens`` ids with one needle per depth."""
    needles = make_needles(seed, depths, "pydoc")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    needle_ids = [(n.depth, ids(f" {n.sentence} ")) for n in needles]
    room = context_tokens - sum(len(i) for _, i in needle_ids)
    if room <= 16:
        raise ValueError(f"context_tokens {context_tokens} is too short for {len(depths)} needles")
    source = ids(text_stream(seed))[:room]
    context = insert_needles(source, needle_ids)
    questions = tuple(ids(f"\n\n{n.question} {n.answer_prefix}") for n in needles)
    return SharedContext(context=context, needles=needles, questions=questions)

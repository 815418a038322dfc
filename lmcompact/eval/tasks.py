"""Task construction and scoring, model-free: needles, agreement, perplexity.

needle
    A haystack of ``context`` tokens with ``num_needles`` sentences such as
    "The secret passkey of the blue door is 48213." inserted at given depths;
    the question asks for one of them. Scored 1.0 when the first number the
    model produces equals the passkey.
agreement
    Greedy tokens under the compacted cache vs the full cache: token accuracy
    (position-wise equality over the N new tokens) and first divergence.
ppl
    Perplexity of a continuation after a compacted context.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COLORS = ("blue", "red", "green", "yellow", "white", "black", "silver", "orange")
ANSWER_PREFIX = "The secret passkey of the {color} door is"


@dataclass(frozen=True)
class Needle:
    color: str
    passkey: str
    depth: float

    @property
    def sentence(self) -> str:
        return f"The secret passkey of the {self.color} door is {self.passkey}. Remember it."


@dataclass(frozen=True)
class NeedlePrompt:
    """One needle sample: the prompt ids and what the answer must contain.

    Attributes:
        input_ids: Token ids of the whole prompt (chat template applied).
        needles: Every needle inserted (depth in [0, 1] of the haystack).
        target: The needle the question asks about.
    """

    input_ids: list[int]
    needles: tuple[Needle, ...]
    target: Needle


def make_needles(seed: int, depths: Sequence[float]) -> tuple[Needle, ...]:
    """Needles with distinct colors and random 5-digit passkeys, one per depth."""
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    if len(depths) > len(COLORS):
        raise ValueError(f"at most {len(COLORS)} needles per prompt, got {len(depths)}")
    rng = random.Random(seed)
    colors = rng.sample(COLORS, len(depths))
    return tuple(
        Needle(color=c, passkey=str(rng.randrange(10_000, 100_000)), depth=d)
        for c, d in zip(colors, depths, strict=True)
    )


def insert_needles(haystack: list[int], needles: Sequence[tuple[float, list[int]]]) -> list[int]:
    """Insert tokenized needle sentences into ``haystack`` ids at fractional depths.

    Args:
        haystack: Token ids.
        needles: ``(depth, ids)`` pairs; depth 0 is the start, 1 the end.
    """
    cuts = sorted(((round(d * len(haystack)), ids) for d, ids in needles), key=lambda x: x[0])
    out: list[int] = []
    last = 0
    for cut, ids in cuts:
        out += haystack[last:cut] + ids
        last = cut
    return out + haystack[last:]


def build_needle_prompt(
    tokenizer: Any,
    text: str,
    context: int,
    seed: int,
    depths: Sequence[float] = (0.5,),
    ask: int = 0,
) -> NeedlePrompt:
    """A chat prompt of about ``context`` tokens hiding needles in ``text``.

    The document is trimmed so the whole prompt (template, question, answer
    prefix) is ``context`` tokens long; ``ask`` picks which needle is asked for.
    """
    needles = make_needles(seed, depths)
    target = needles[ask]
    question = f"What is the secret passkey of the {target.color} door?"
    prefix = ANSWER_PREFIX.format(color=target.color)

    def render(document: str) -> list[int]:
        messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(rendered + prefix, add_special_tokens=False)["input_ids"])

    overhead = len(render("")) + sum(len(tokenizer(" " + n.sentence)["input_ids"]) for n in needles)
    room = context - overhead
    if room <= 16:
        raise ValueError(f"context {context} is too short for the template and needles")
    hay_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"][:room])
    inserted = insert_needles(
        hay_ids,
        [
            (
                n.depth,
                list(tokenizer(" " + n.sentence + " ", add_special_tokens=False)["input_ids"]),
            )
            for n in needles
        ],
    )
    document = tokenizer.decode(inserted)
    ids = render(document)
    # decode/encode round trips can shift a few tokens; trim the haystack to fit exactly
    excess = len(ids) - context
    if excess > 0:
        hay_ids = hay_ids[: len(hay_ids) - excess]
        inserted = insert_needles(
            hay_ids,
            [
                (
                    n.depth,
                    list(tokenizer(" " + n.sentence + " ", add_special_tokens=False)["input_ids"]),
                )
                for n in needles
            ],
        )
        ids = render(tokenizer.decode(inserted))
    return NeedlePrompt(input_ids=ids, needles=needles, target=target)


_NUMBER = re.compile(r"\d[\d,]*")


def score_needle(answer: str, passkey: str) -> float:
    """1.0 when the first number in ``answer`` (commas dropped) is ``passkey``, else 0.0."""
    match = _NUMBER.search(answer)
    if match is None:
        return 0.0
    return 1.0 if match.group().replace(",", "") == passkey else 0.0


@dataclass(frozen=True)
class Agreement:
    """Greedy agreement of ``got`` with ``reference`` over ``n`` tokens.

    Attributes:
        token_accuracy: Fraction of positions where the tokens are equal.
        first_divergence: Index of the first differing token, or None.
        n: Number of reference tokens compared.
    """

    token_accuracy: float
    first_divergence: int | None
    n: int


def agreement(reference: Sequence[int], got: Sequence[int]) -> Agreement:
    """Compare two greedy continuations position by position (missing tokens differ)."""
    n = len(reference)
    if n == 0:
        raise ValueError("agreement needs at least one reference token")
    equal = [i < len(got) and got[i] == reference[i] for i in range(n)]
    first = next((i for i, ok in enumerate(equal) if not ok), None)
    return Agreement(token_accuracy=sum(equal) / n, first_divergence=first, n=n)


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(mean NLL)``; raises ValueError for an empty continuation."""
    if count <= 0:
        raise ValueError(f"perplexity needs at least one token, got {count}")
    return math.exp(nll_sum / count)

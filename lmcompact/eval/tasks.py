"""Task construction and scoring, model-free: needles, agreement, perplexity.

needle
    Passkey retrieval: a prompt of ``context`` tokens hides one or more
    passkey sentences at given depths and asks for one of them. Scored 1.0 when
    the first number the model produces equals the passkey. Two haystacks:

    ``passkey`` (default)
        The passkey-retrieval prompt of Mohtashami & Jaggi, "Landmark Attention:
        Random-Access Infinite Context Length for Transformers" (2023,
        arXiv:2305.16300, Section 4.2 and the ``run_test.py`` prompt of their
        code): a task description, the filler "The grass is green. The sky is
        blue. The sun is yellow. Here we go. There and back again." repeated,
        "The pass key is NNNNN. Remember it. NNNNN is the pass key." between two
        filler sentences, and "What is the pass key? The pass key is".
    ``pydoc``
        Python's ``pydoc_data`` text as haystack with sentences "The secret
        passkey of the <color> door is NNNNN. Remember it." cut in anywhere.

    The prompt is plain text by default; ``prompt_format="chat"`` wraps it in
    the tokenizer's chat template (user turn, then the answer prefix as the
    start of the assistant turn). SmolLM2-135M-Instruct retrieves with the
    full cache at 4k tokens only in plain form (docs/eval/RESULTS.md).
agreement
    Greedy tokens under the compacted cache vs the full cache: token accuracy
    (position-wise equality over the N new tokens) and first divergence.
ppl
    Perplexity of a continuation after a compacted context.
multi_needle (``--engine vllm``)
    One natural-text context (:func:`build_stored_context`) hides several labelled
    needles at different depths; several different questions are asked against it, each
    a separate request whose prompt is the context plus the question. A context compacted
    when it is stored (before any question exists) must serve all of them, so this task
    judges whether compaction at save time is query-agnostic.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COLORS = ("blue", "red", "green", "yellow", "white", "black", "silver", "orange")
HAYSTACKS = ("passkey", "pydoc")
PROMPT_FORMATS = ("plain", "chat")

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize them. I will quiz you about the important information there."
)
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)


@dataclass(frozen=True)
class Needle:
    """One hidden fact.

    Attributes:
        color: Names the needle when a prompt holds several (the question names it).
        passkey: Five digits.
        depth: Position in the haystack, 0 (start) to 1 (end).
        labelled: Whether the sentences name the color; a single passkey-haystack
            needle is unlabelled, as in the original passkey prompt.
        haystack: Which sentence style (see the module docstring).
    """

    color: str
    passkey: str
    depth: float
    labelled: bool = True
    haystack: str = "pydoc"

    @property
    def _label(self) -> str:
        return f" of the {self.color} door" if self.labelled else ""

    @property
    def sentence(self) -> str:
        if self.haystack == "passkey":
            key, label = self.passkey, self._label
            return f"The pass key{label} is {key}. Remember it. {key} is the pass key{label}."
        return f"The secret passkey{self._label} is {self.passkey}. Remember it."

    @property
    def question(self) -> str:
        noun = "pass key" if self.haystack == "passkey" else "secret passkey"
        return f"What is the {noun}{self._label}?"

    @property
    def answer_prefix(self) -> str:
        noun = "pass key" if self.haystack == "passkey" else "secret passkey"
        return f"The {noun}{self._label} is"


@dataclass(frozen=True)
class NeedlePrompt:
    """One needle sample: the prompt ids and what the answer must contain.

    Attributes:
        input_ids: Token ids of the whole prompt.
        needles: Every needle inserted (depth in [0, 1] of the haystack).
        target: The needle the question asks about.
    """

    input_ids: list[int]
    needles: tuple[Needle, ...]
    target: Needle


def make_needles(seed: int, depths: Sequence[float], haystack: str = "pydoc") -> tuple[Needle, ...]:
    """Needles with distinct colors and random 5-digit passkeys, one per depth."""
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    if len(depths) > len(COLORS):
        raise ValueError(f"at most {len(COLORS)} needles per prompt, got {len(depths)}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; allowed: {', '.join(HAYSTACKS)}")
    labelled = haystack != "passkey" or len(depths) > 1
    rng = random.Random(seed)
    colors = rng.sample(COLORS, len(depths))
    return tuple(
        Needle(
            color=c,
            passkey=str(rng.randrange(10_000, 100_000)),
            depth=d,
            labelled=labelled,
            haystack=haystack,
        )
        for c, d in zip(colors, depths, strict=True)
    )


def insert_needles(
    haystack: list[int], needles: Sequence[tuple[float, list[int]]], unit: int = 1
) -> list[int]:
    """Insert tokenized needle sentences into ``haystack`` ids at fractional depths.

    Args:
        haystack: Token ids.
        needles: ``(depth, ids)`` pairs; depth 0 is the start, 1 the end.
        unit: Cuts snap to multiples of ``unit`` tokens (whole filler sentences).
    """
    cuts = sorted(
        ((min(len(haystack), round(d * len(haystack) / unit) * unit), ids) for d, ids in needles),
        key=lambda x: x[0],
    )
    out: list[int] = []
    last = 0
    for cut, ids in cuts:
        out += haystack[last:cut] + ids
        last = cut
    return out + haystack[last:]


def build_needle_prompt(
    tokenizer: Any,
    context: int,
    seed: int,
    depths: Sequence[float] = (0.5,),
    ask: int = 0,
    haystack: str = "passkey",
    prompt_format: str = "plain",
    text: str | None = None,
) -> NeedlePrompt:
    """A prompt of exactly ``context`` tokens hiding needles in a haystack.

    Args:
        tokenizer: A transformers tokenizer (``apply_chat_template`` for chat).
        context: Prompt length in tokens; the haystack is trimmed at its end
            to fit exactly.
        seed: Chooses the passkeys and colors.
        depths: One needle per depth.
        ask: Which needle the question asks for.
        haystack: ``"passkey"`` or ``"pydoc"`` (see the module docstring).
        prompt_format: ``"plain"`` text or ``"chat"`` template.
        text: Haystack text for ``haystack="pydoc"``; ignored for ``"passkey"``
            (its filler is fixed).
    """
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(
            f"unknown prompt format {prompt_format!r}; allowed: {', '.join(PROMPT_FORMATS)}"
        )
    needles = make_needles(seed, depths, haystack)
    target = needles[ask]
    if haystack == "passkey":
        intro, separator, tail = PASSKEY_INTRO + "\n", "\n", ""
        unit_ids = list(tokenizer(" " + PASSKEY_FILLER, add_special_tokens=False)["input_ids"])
        unit = len(unit_ids)
        source = unit_ids * (context // max(1, unit) + 2)
    else:
        if text is None:
            raise ValueError("the pydoc haystack needs its text")
        # the haystack is cut mid-word: a space after the needle keeps words apart
        intro, separator, tail, unit = "", "\n\n", " ", 1
        source = list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(document: str) -> list[int]:
        body = f"{intro}{document.strip()}{separator}{target.question}"
        if prompt_format == "chat":
            messages = [{"role": "user", "content": body}]
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return list(
                tokenizer(rendered + target.answer_prefix, add_special_tokens=False)["input_ids"]
            )
        return list(
            tokenizer(f"{body} {target.answer_prefix}", add_special_tokens=False)["input_ids"]
        )

    needle_ids = [
        (n.depth, list(tokenizer(f" {n.sentence}{tail}", add_special_tokens=False)["input_ids"]))
        for n in needles
    ]
    overhead = len(render("")) + sum(len(ids) for _, ids in needle_ids)
    room = context - overhead
    if room <= 16:
        raise ValueError(f"context {context} is too short for the prompt and needles")
    size = room

    def build(size: int) -> list[int]:
        return render(tokenizer.decode(insert_needles(source[:size], needle_ids, unit)))

    ids = build(size)
    # decode/encode round trips (and stripping) shift a few tokens: resize the haystack
    for _ in range(4):
        if len(ids) == context:
            break
        size += context - len(ids)
        ids = build(size)
    while len(ids) > context and size > 0:
        size -= 1
        ids = build(size)
    return NeedlePrompt(input_ids=ids, needles=needles, target=target)


FACTS = (
    ("secret passkey", "the blue door"),
    ("combination", "Anna's safe"),
    ("licence number", "the red car"),
    ("street number", "Tom's house"),
    ("ticket number", "the night train"),
    ("account number", "the village bakery"),
    ("room number", "Doctor Lee"),
    ("serial number", "the old radio"),
)
"""(noun, owner) pairs of :class:`Fact` needles: distinct words, so a question names one."""


@dataclass(frozen=True)
class Fact:
    """One needle of a :class:`StoredContext`: "The <noun> of <owner> is NNNNN."

    Attributes:
        noun: What the number is ("combination").
        owner: Whose it is ("Anna's safe").
        passkey: Five digits.
        depth: Position in the haystack, 0 (start) to 1 (end).
    """

    noun: str
    owner: str
    passkey: str
    depth: float

    @property
    def sentence(self) -> str:
        subject = f"the {self.noun} of {self.owner}"
        key = self.passkey
        return f"The {self.noun} of {self.owner} is {key}. Remember it. {key} is {subject}."

    @property
    def question(self) -> str:
        return f"What is the {self.noun} of {self.owner}?"

    @property
    def answer_prefix(self) -> str:
        return f"The {self.noun} of {self.owner} is"


def make_facts(seed: int, depths: Sequence[float]) -> tuple[Fact, ...]:
    """Facts with distinct (noun, owner) pairs and random 5-digit passkeys, one per depth."""
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    if len(depths) > len(FACTS):
        raise ValueError(f"at most {len(FACTS)} needles per context, got {len(depths)}")
    rng = random.Random(seed)
    pairs = rng.sample(FACTS, len(depths))
    return tuple(
        Fact(noun, owner, str(rng.randrange(10_000, 100_000)), depth)
        for (noun, owner), depth in zip(pairs, depths, strict=True)
    )


@dataclass(frozen=True)
class StoredContext:
    """A context that several questions are asked against (the ``multi_needle`` task).

    The prompt of question ``i`` is ``context_ids + question_ids[i]``: the context is built
    token by token (exactly ``len(context_ids)`` tokens, a multiple of a store chunk when
    the requested length is) so that every question request shares it as a prefix.

    Attributes:
        context_ids: The haystack with every needle.
        needles: The needles, in the order of the questions.
        question_ids: One suffix per needle: the question and the answer prefix.
    """

    context_ids: list[int]
    needles: tuple[Fact | Needle, ...]
    question_ids: tuple[list[int], ...]

    def prompt(self, index: int) -> list[int]:
        """Token ids of question ``index`` asked after the context."""
        return self.context_ids + self.question_ids[index]


def build_stored_context(
    tokenizer: Any,
    context: int,
    seed: int,
    depths: Sequence[float],
    text: str,
    needles: Sequence[Fact | Needle] | None = None,
) -> StoredContext:
    """``context`` tokens of natural text hiding one :class:`Fact` per depth.

    Each fact ("The combination of Anna's safe is NNNNN. Remember it. NNNNN is the
    combination of Anna's safe.") is cut into the tokenized ``text`` at its depth; the
    questions ask for each in turn ("What is the combination of Anna's safe? The
    combination of Anna's safe is"), plain text, no chat template. Facts rather than
    :class:`Needle` sentences, which differ only in a color: a small model answers the
    doors' questions with the wrong door's number far more often (the figures:
    ``docs/eval/README.md``, ``multi_needle``).

    ``needles`` hides these instead (their own depths; e.g. :func:`make_needles`'s colored
    doors, the sentences of ``scripts/agnostic_needles.py``); None: :func:`make_facts`.
    """
    hidden = tuple(make_facts(seed, depths) if needles is None else needles)

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    needle_ids = [(n.depth, encode(f" {n.sentence} ")) for n in hidden]
    room = context - sum(len(ids) for _, ids in needle_ids)
    source = encode(text)
    if room <= 16 or len(source) < room:
        raise ValueError(f"context {context} cannot hold {len(hidden)} needles in this text")
    ids = insert_needles(source[:room], needle_ids)
    questions = tuple(encode(f"\n\n{n.question} {n.answer_prefix}") for n in hidden)
    return StoredContext(context_ids=ids, needles=hidden, question_ids=questions)


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

"""A tiny random-weight Llama that vLLM loads offline, for fast connector tests.

Builds, in a folder, a word-level tokenizer trained locally with ``tokenizers`` on
Python's own ``pydoc_data.topics`` text, a two-layer Llama config whose head size the
CPU attention backend supports (64), and float32 safetensors with seeded random
weights. Nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

TINY_LAYERS = 2
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 64


def corpus_words(limit: int = 200_000) -> list[str]:
    """Words of ``pydoc_data.topics`` (always installed with CPython)."""
    from pydoc_data.topics import topics

    text = " ".join(topics.values())
    return re.findall(r"[A-Za-z]+|[0-9]|[^\sA-Za-z0-9]", text)[:limit]


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write tokenizer, config and random weights of a tiny Llama into ``folder``.

    Returns:
        ``folder`` (idempotent: an existing ``config.json`` is reused).
    """
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"])
    words = corpus_words()
    tok.train_from_iterator(
        [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)], trainer
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=TINY_HEADS * TINY_HEAD_DIM,
        intermediate_size=512,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than HF's init: attention gets peaky, tests sharper
        for name, param in model.named_parameters():
            if "proj" in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_prompt_ids(length: int, seed: int = 0, vocab: int = 1500) -> list[int]:
    """Deterministic pseudo-random token ids in ``[3, vocab)`` (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]

"""A tiny random-weight Llama that vLLM loads offline, for fast connector checks.

Builds, in a folder, a word-level tokenizer trained locally with ``tokenizers`` on
Python's own ``pydoc_data.topics`` text, a two-layer Llama config whose head size the
CPU attention backend supports (64), and float32 safetensors with seeded random
weights (:func:`build_tiny_llama`); :func:`write_random_llama` writes other shapes next to
that tokenizer (the GPU round trip's SmolLM2-shaped model). Nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
        ``folder`` (idempotent: an existing ``model.safetensors`` is reused).
    """
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    vocab = write_word_tokenizer(folder)
    write_random_llama(
        folder,
        vocab_size=vocab,
        layers=TINY_LAYERS,
        heads=TINY_HEADS,
        kv_heads=TINY_KV_HEADS,
        head_dim=TINY_HEAD_DIM,
        hidden=TINY_HEADS * TINY_HEAD_DIM,
        intermediate=512,
        proj_std=0.08,
        seed=seed,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return folder


def write_word_tokenizer(folder: Path) -> int:
    """Train the word-level tokenizer (2000 words of ``pydoc_data.topics``) into ``folder``;
    return its vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return int(tok.get_vocab_size())


def write_random_llama(
    folder: Path,
    *,
    vocab_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    intermediate: int,
    proj_std: float,
    seed: int,
    bfloat16: bool = False,
    **config: Any,
) -> None:
    """Write the config and seeded random weights of a Llama into ``folder``.

    The attention and MLP projections are drawn from ``N(0, proj_std)`` (larger than HF's
    init: attention gets peaky, tests sharper); ``config`` adds ``LlamaConfig`` fields;
    ``bfloat16`` saves the weights in bf16 (float32 otherwise).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        bos_token_id=1,
        eos_token_id=2,
        **config,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "proj" in name:
                param.normal_(0.0, proj_std)
    if bfloat16:
        model = model.bfloat16()
    model.save_pretrained(folder, safe_serialization=True)


def tiny_prompt_ids(length: int, seed: int = 0, vocab: int = 1500) -> list[int]:
    """Deterministic pseudo-random token ids in ``[3, vocab)`` (no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]

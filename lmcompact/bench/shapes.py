"""Model shapes the benchmarks build with random weights (transformers config fields).

The dimensions of public Llama models, so speed and memory figures describe real model
sizes; weights are random (``load_format="dummy"`` in vLLM, seeded init in transformers).
"""

from __future__ import annotations

from typing import Any

LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: 16 layers, 32 q / 8 kv heads, head_dim 64
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    # Llama-3-8B: 32 layers, 32 q / 8 kv heads, head_dim 128
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
}

"""How much int8 stored rows err on a real model's KV: one scale per row against the store's
one scale per 64 channels (:mod:`lmcompact.store.quant`).

    PYTHONPATH=$PWD python scripts/key_quant_error.py --models smollm2 gemma3-270m \
        --json docs/benchmarks/store-quantization-models.json

A float32 transformers prefill of a natural-text prompt (``--tokens`` of the pydoc text the
eval's haystacks use, seed 0) gives every layer's post-RoPE keys and values; each layer's
rows go through the store's codec (:class:`lmcompact.store.ChunkCodec`, ``int8``) and, for
comparison, through one symmetric int8 scale per row (``absmax / 127``, computed here).
Reported per layer: the relative Frobenius error ``||x' - x|| / ||x||`` of keys and values.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcompact.eval.text import text_stream
from lmcompact.hf.prepare import prepare_model
from lmcompact.store import ChunkCodec, CompactedChunk, StoreNamespace

warnings.filterwarnings("ignore", message="The given buffer is not writable")


def per_row_int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(..., d)`` through one symmetric int8 scale per row (the former format)."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return (x / scale.clamp(min=1e-30)).round() * scale


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact.double()).norm() / exact.double().norm())


def layer_kv(model_name: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(H, T, D)`` float32 keys and values of a ``tokens``-token prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = prepare_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer(text_stream(0), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def measure(model_name: str, tokens: int) -> dict[str, Any]:
    namespace = StoreNamespace(model_id=model_name, kv_dtype="float32", kv_layout="transformers")
    codec = ChunkCodec(namespace, quantize="int8")
    rows = []
    for index, (keys, values) in enumerate(tqdm(layer_kv(model_name, tokens), desc=model_name)):
        chunk = CompactedChunk.from_dense(keys.unsqueeze(0), values.unsqueeze(0)).clone()
        back = codec.decode(codec.encode(chunk).tobytes())
        rows.append(
            {
                "layer": index,
                "head_dim": int(keys.shape[-1]),
                "keys_per_row": rel_error(per_row_int8(keys), keys),
                "keys_per_64": rel_error(back.keys, chunk.keys),
                "values_per_row": rel_error(per_row_int8(values), values),
                "values_per_64": rel_error(back.values, chunk.values),
            }
        )
    return {"model": model_name, "tokens": tokens, "layers": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    results = [measure(name, args.tokens) for name in args.models]
    print("| model | head dim | keys: per row | keys: per 64 | values: per row | values: per 64 |")
    print("|---|---|---|---|---|---|")
    for result in results:
        layers = result["layers"]
        cells = []
        for name in ("keys_per_row", "keys_per_64", "values_per_row", "values_per_64"):
            got = [row[name] for row in layers]
            cells.append(f"{min(got):.4f}-{max(got):.4f}")
        print(f"| {result['model']} | {layers[0]['head_dim']} | " + " | ".join(cells) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""GGUF -> float32 safetensors folder, and the checks a prepared folder must pass.

:func:`convert_gguf` dequantizes with transformers' GGUF loader, saves model and
tokenizer, and :func:`verify_folder` loads the saved folder fresh: config fields, no
leftover quantization config, ``<bos>`` where the model needs it, and the same greedy
token as the source model on a smoke prompt. transformers is imported inside the
functions (``lmcompact.hf.prepare`` stays cheap to import).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def convert_gguf(
    gguf: Path, out: Path, expect: dict[str, Any], add_bos_token: bool
) -> dict[str, Any]:
    """Dequantize ``gguf`` into a float32 safetensors folder ``out`` and verify it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 safetensors folder", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if add_bos_token:
        tokenizer.add_bos_token = True  # type: ignore[misc]  # rebuilds the post-processor saved in tokenizer.json
    # The GGUF loader leaves a quantizer behind although the weights are now plain
    # floats; save_pretrained would record it and the folder would not load.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    expected_token = _smoke_token(model, tokenizer)
    del model
    return verify_folder(out, expect, expected_token, add_bos_token)


def _smoke_prompt(tokenizer: Any) -> Any:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer("The capital of France is", return_tensors="pt")["input_ids"]


def _smoke_token(model: Any, tokenizer: Any) -> int:
    import torch

    with torch.no_grad():
        logits = model(_smoke_prompt(tokenizer)).logits
    return int(logits[0, -1].argmax())


def verify_folder(
    folder: Path,
    expect: dict[str, Any],
    expected_token: int | None = None,
    add_bos_token: bool = False,
) -> dict[str, Any]:
    """Load ``folder`` fresh, check config fields and one greedy token.

    Args:
        folder: A saved HF folder.
        expect: Config attribute -> required value.
        expected_token: The greedy next token the source model produced for the
            smoke prompt; the saved model must produce the same.
        add_bos_token: The saved tokenizer must prepend its ``<bos>`` token.

    Returns:
        A summary of what was checked (stored in the marker).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(folder))
    for field_name, value in expect.items():
        actual = getattr(config, field_name, None)
        if actual != value:
            raise RuntimeError(f"{folder}: config.{field_name} is {actual!r}, expected {value!r}")
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"{folder}: config still carries a quantization_config")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if add_bos_token and tokenizer("x")["input_ids"][0] != tokenizer.bos_token_id:
        raise RuntimeError(f"{folder}: the saved tokenizer does not prepend its <bos> token")
    token = _smoke_token(model, tokenizer)
    if expected_token is not None and token != expected_token:
        raise RuntimeError(
            f"{folder}: saved model predicts token {token}, the source predicted {expected_token}"
        )
    return {
        "config": {k: getattr(config, k, None) for k in expect},
        "smoke_prompt": tokenizer.decode(_smoke_prompt(tokenizer)[0]),
        "smoke_token": token,
        "smoke_text": tokenizer.decode([token]),
        "parameters": sum(p.numel() for p in model.parameters()),
    }

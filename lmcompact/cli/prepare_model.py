"""``lmcompact prepare-model``: fetch and convert a model into a local HF folder."""

from __future__ import annotations

import argparse

NAME = "prepare-model"
HELP = (
    "prepare a model folder (smollm2, gemma3-270m, a local HF folder or a .gguf file); "
    "prints the folder"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        help="known name (smollm2, gemma3-270m), local HF folder or .gguf file (default: smollm2)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where prepared models go (default: $LMCOMPACT_CACHE/models or "
        "~/.cache/lmcompact/models)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")


def run(args: argparse.Namespace) -> int:
    from lmcompact.hf.prepare import prepare_model

    print(prepare_model(args.model, cache_dir=args.cache_dir, force=args.force))
    return 0

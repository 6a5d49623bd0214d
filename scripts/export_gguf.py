#!/usr/bin/env python3
"""Export a llamatrain checkpoint (or run folder, or any llama GGUF) as a llama.cpp model.

A thin wrapper around ``llamatrain.load`` + ``llamatrain.export_gguf`` for people who drive
exports from their own tooling; ``llamatrain export`` is the same thing as a subcommand.

    python scripts/export_gguf.py runs/shakespeare -o shakespeare-q8_0.gguf --type q8_0
"""

import argparse
import sys

from llamatrain import api
from llamatrain.errors import LlamatrainError
from llamatrain.gguf.export_types import EXPORT_TYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint, run folder or llama GGUF")
    parser.add_argument("-o", "--output", required=True, help="GGUF file to write")
    parser.add_argument("--type", choices=EXPORT_TYPES, default="f32")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = api.load(args.checkpoint)
        path = api.export_gguf(model, tokenizer, args.output, type=args.type)
    except LlamatrainError as err:
        print(f"export_gguf: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size:,} bytes, {args.type})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

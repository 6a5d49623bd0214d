"""``llamatrain`` command line: fit | generate | eval | export | info | plot.

The CLI only parses arguments, builds objects through ``llamatrain.api`` and calls them.
User errors (``LlamatrainError``) print one line and exit 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from llamatrain.errors import LlamatrainError

EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def cmd_fit(args: argparse.Namespace) -> int:
    from llamatrain import api

    result = api.fit(args.config, overrides=args.set, resume=args.resume)
    print(f"run directory: {result.run_dir}")
    if result.export_path is not None:
        print(f"exported GGUF: {result.export_path}")
    if result.curves_path is not None:
        print(f"training curves: {result.curves_path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llamatrain import api

    model, tokenizer = api.load(args.checkpoint)
    stream = api.generate_text(
        model,
        tokenizer,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from llamatrain import api

    model, tokenizer = api.load(args.checkpoint)
    result = api.evaluate_text(model, tokenizer, args.data, n_ctx=args.n_ctx)
    print(f"tokens:          {result.n_tokens}")
    print(f"mean loss:       {result.mean_loss:.4f}  (ppl {result.mean_ppl:.4f})")
    print(
        f"perplexity:      {result.perplexity:.4f}  (llama-perplexity method: "
        f"{result.n_chunks} chunks of {result.n_ctx}, second halves scored)"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llamatrain import api

    model, tokenizer = api.load(args.checkpoint)
    path = api.export_gguf(model, tokenizer, args.output, type=args.type)
    print(f"wrote {path} ({path.stat().st_size:,} bytes, {args.type})")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from llamatrain import api

    print(api.describe_gguf(args.file))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from llamatrain.plot import plot_metrics

    path = plot_metrics(args.run_dir, args.output)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamatrain", description="Train llama models in PyTorch; run them in llama.cpp."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    fit = sub.add_parser("fit", help="train a model from a TOML config")
    fit.add_argument("--config", help="TOML config file (default: built-in defaults)")
    fit.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    fit.add_argument(
        "--resume",
        metavar="PATH|latest",
        help="continue from a checkpoint ('latest' = the run's newest)",
    )
    fit.set_defaults(func=cmd_fit)

    gen = sub.add_parser("generate", help="sample text from a checkpoint or GGUF model")
    gen.add_argument("checkpoint")
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--repeat-penalty", type=float, default=1.1)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="perplexity of a model on a text file")
    ev.add_argument("checkpoint")
    ev.add_argument("--data", required=True, help="text file to score")
    ev.add_argument("--n-ctx", type=int, default=None, help="chunk size (default: model's)")
    ev.set_defaults(func=cmd_eval)

    ex = sub.add_parser("export", help="write a llama.cpp model GGUF from a checkpoint")
    ex.add_argument("checkpoint")
    ex.add_argument("-o", "--output", required=True)
    ex.add_argument("--type", choices=EXPORT_TYPES, default="f32")
    ex.set_defaults(func=cmd_export)

    info = sub.add_parser("info", help="describe a GGUF file")
    info.add_argument("file")
    info.set_defaults(func=cmd_info)

    plot = sub.add_parser("plot", help="draw loss, lr and perplexity curves of a run to a PNG")
    plot.add_argument("run_dir", help="run folder (output.dir) or its metrics.jsonl")
    plot.add_argument(
        "-o", "--output", default=None, help="PNG to write (default: RUN_DIR/curves.png)"
    )
    plot.set_defaults(func=cmd_plot)
    return parser


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Call a command, turning user errors into one message and exit code 1."""
    try:
        return func(args)
    except LlamatrainError as err:
        if args.debug:
            raise
        print(f"llamatrain: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llamatrain: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args.func, args)

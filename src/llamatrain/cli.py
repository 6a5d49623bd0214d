"""``llamatrain`` command line: fit | generate | eval | export | info | plot.

The CLI only parses arguments, builds objects through ``llamatrain.api`` and calls them.
User errors (``LlamatrainError``) and files that cannot be read or written (``OSError``) print
one line and exit 1; ``--debug`` shows the traceback. ``llamatrain.api`` (and with it torch)
is imported inside the commands, so ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from dataclasses import fields

from llamatrain.errors import ConfigError, GGUFError, LlamatrainError, shown
from llamatrain.gguf.export_types import (
    AUTO_EXPORT_TYPE,
    EXPORT_TYPES,
    QUANTIZER_TYPES,
    RUN_EXPORT_TYPES,
)
from llamatrain.sampling import MAX_NEW_TOKENS, SamplingError, SamplingParams

GENERATING = {
    "phase": "while loading the model or generating",
    "remedy": "lower --max-tokens (the cache for every token is allocated up front), drop "
    "--dequantize, or use a smaller or more quantized model",
}
"""Running out of memory in ``generate`` and ``chat``: ``memory.out_of_memory_in``'s words."""
SCORING = {
    "phase": "while loading the model or scoring the text",
    "remedy": "lower --n-ctx (each chunk's logits and attention grow with it), drop --dequantize, "
    "or use a smaller model",
}
"""Running out of memory in ``eval``."""
EXPORTING = {
    "phase": "while exporting",
    "remedy": "export on a machine with more free memory (an HF folder is read whole, in "
    "float32), or a LoRA run's adapter alone (--adapter)",
}
"""Running out of memory in ``export``."""

MAX_SEED = (1 << 64) - 1


def cmd_fit(args: argparse.Namespace) -> int:
    from llamatrain import api, parallel

    result = api.fit(args.config, overrides=args.set, resume=args.resume, overwrite=args.overwrite)
    if not parallel.is_main():
        return 0  # under torchrun rank 0 reports for all
    if result.history.stopped:
        print(f"stopped early at step {result.history.train[-1]['step']}: {result.history.stopped}")
    print("\n".join(result.history.report.lines()))
    print(f"run directory: {result.run_dir}")
    if result.curves_path is not None:
        print(f"training curves: {result.curves_path}")
    if result.adapter_path is not None:
        print(f"LoRA adapter: {result.adapter_path} (llama-cli --lora, over model.init_from)")
    if result.export_path is not None:
        print(f"exported GGUF: {result.export_path}")
        prompt = shlex.quote(result.config.train.sample_prompt.strip() or "Once upon a time")
        print(
            f"run it in llama.cpp: llama-cli -m {shlex.quote(str(result.export_path))} "
            f"-p {prompt} -n 128"
        )
    return 0


def check_text(flag: str, value: str | None) -> None:
    """Refuse (ConfigError) a text flag holding bytes that are not UTF-8 (Python gives them as
    lone surrogates, which no tokenizer can encode), before any model is read."""
    if value is not None and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(
                f"{flag} holds bytes that are not UTF-8 ({shown(value[e.start : e.end])}); "
                "give it as UTF-8 text"
            ) from None


def cmd_generate(args: argparse.Namespace) -> int:
    check_text("--prompt", args.prompt)
    check_text("--chat", args.chat)
    params = sampling_params(args)  # every flag checked before the model is read
    seed = generation_seed(args.seed)
    check_max_tokens(args.max_tokens)
    from llamatrain.denormals import denormals_flushed
    from llamatrain.gguf.mapped_files import reads_checked
    from llamatrain.memory import out_of_memory_in

    with out_of_memory_in(**GENERATING), denormals_flushed(), reads_checked():
        _generate(args, params, seed)
    return 0


def _generate(args: argparse.Namespace, params: SamplingParams, seed: int | None) -> None:
    """``generate``'s model read and its text streamed, the flags checked."""
    from llamatrain import api

    if args.chat is not None:
        model, tokenizer, template = api.load_chat(
            args.checkpoint, args.chat_template, lora=args.lora, dequantize=args.dequantize
        )
        check_cache_fits(model, args.max_tokens)
        reply = api.chat(
            model, tokenizer, template, args.chat, max_tokens=args.max_tokens, params=params,
            seed=seed,
        )  # fmt: skip
        for piece in reply:
            print(piece, end="", flush=True)
        print()
        return
    model, tokenizer = api.load(args.checkpoint, lora=args.lora, dequantize=args.dequantize)
    check_cache_fits(model, args.max_tokens)
    allowed = api.seen_tokens(args.checkpoint) if args.seen_tokens_only else None
    stream = api.generate_text(
        model,
        tokenizer,
        args.prompt,
        max_tokens=args.max_tokens,
        params=params,
        seed=seed,
        allowed=allowed,
    )
    for piece in stream:
        print(piece, end="", flush=True)
    print()


def cmd_chat(args: argparse.Namespace) -> int:
    """Talk to a model over several turns: a user turn a line from standard input (a prompt
    shows on a terminal), the reply streamed, the conversation kept; ``/reset`` forgets it
    (the system prompt stays), ``/exit``, an empty line or the end of input ends it."""
    check_text("--system", args.system)
    params = sampling_params(args)
    seed = generation_seed(args.seed)
    check_max_tokens(args.max_tokens)
    from llamatrain.denormals import denormals_flushed
    from llamatrain.gguf.mapped_files import reads_checked
    from llamatrain.memory import out_of_memory_in

    with out_of_memory_in(**GENERATING), denormals_flushed(), reads_checked():
        _chat(args, params, seed)
    return 0


def _chat(args: argparse.Namespace, params: SamplingParams, seed: int | None) -> None:
    """``chat``'s conversation, turn by turn, the flags checked."""
    from llamatrain import api

    model, tokenizer, template = api.load_chat(
        args.checkpoint, args.chat_template, lora=args.lora, dequantize=args.dequantize
    )
    check_cache_fits(model, args.max_tokens)
    conversation = api.Conversation(
        model, tokenizer, template, args.system, max_tokens=args.max_tokens, params=params,
        seed=seed,
    )  # fmt: skip
    interactive = sys.stdin.isatty()
    if interactive:
        print("type a message; /reset forgets the conversation, /exit (or Ctrl-D) ends it")
    while (line := _user_turn(interactive)) not in (None, "", "/exit"):
        if line == "/reset":
            conversation.reset()
            continue
        try:
            for piece in conversation.say(line):
                print(piece, end="", flush=True)
        except ConfigError as e:  # a turn too long for the context: the chat goes on
            print(f"llamatrain: error: {e}", file=sys.stderr)
            continue
        print()


def _user_turn(interactive: bool) -> str | None:
    """The next user line (None at the end of input); input that is not UTF-8 ends the chat
    in one line (its bytes cannot be told apart from the next turn's)."""
    try:
        line = input("> " if interactive else "")
    except EOFError:
        return None
    except UnicodeDecodeError:
        raise ConfigError(
            "standard input holds bytes that are not UTF-8; give the conversation as UTF-8 text"
        ) from None
    check_text("a turn", line)
    return line.strip()


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampler flags as SamplingParams; a value out of range is one line naming its flag."""
    try:
        return SamplingParams(**{f.name: getattr(args, f.name) for f in fields(SamplingParams)})
    except SamplingError as e:
        raise ConfigError(f"--{e.field.replace('_', '-')} {e.value}: must be {e.rule}") from None


def check_max_tokens(max_tokens: int) -> None:
    """--max-tokens within what a cache allocated up front for every token can be."""
    if not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(
            f"--max-tokens {max_tokens}: must be between 1 and {MAX_NEW_TOKENS:,} (the "
            "cache for every token is allocated up front)"
        )


def check_cache_fits(model, max_tokens: int) -> None:
    """Refuse a --max-tokens whose KV cache (allocated up front) exceeds half the machine's
    memory, before allocating it."""
    from llamatrain.memory import kv_cache_bytes

    n_bytes = kv_cache_bytes(model.cfg, max_tokens, next(model.parameters()).element_size())
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: nothing to compare with
        return
    if n_bytes > memory // 2:
        raise ConfigError(
            f"--max-tokens {max_tokens}: the cache for that many tokens needs "
            f"{n_bytes / 2**30:.1f} GiB, more than half of this machine's "
            f"{memory / 2**30:.1f} GiB; ask for fewer tokens"
        )


def generation_seed(seed: int | None) -> int | None:
    """``--seed``: -1 (or none) draws a random seed, as llama.cpp's ``--seed -1`` does."""
    if seed is None or seed == -1:
        return None
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed}: must be between 0 and 2^64-1, or -1 for a random seed")
    return seed


def cmd_eval(args: argparse.Namespace) -> int:
    if args.n_ctx is not None and args.n_ctx < 4:
        raise ConfigError(
            f"--n-ctx {args.n_ctx}: must be at least 4 (each chunk's second half is scored), "
            "or left out for the model's context"
        )
    from llamatrain import api
    from llamatrain.denormals import denormals_flushed
    from llamatrain.gguf.mapped_files import reads_checked
    from llamatrain.memory import out_of_memory_in

    with out_of_memory_in(**SCORING), denormals_flushed(), reads_checked():
        model, tokenizer = api.load(args.checkpoint, lora=args.lora, dequantize=args.dequantize)
        result = api.perplexity(model, tokenizer, args.data, n_ctx=args.n_ctx)
    print(f"tokens:          {result.n_tokens}")
    print(f"mean loss:       {result.mean_loss:.4f}  (ppl {result.mean_ppl:.4f})")
    print(
        f"perplexity:      {result.perplexity:.4f}  (llama-perplexity method: "
        f"{result.n_chunks} chunks of {result.n_ctx}, second halves scored)"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llamatrain.gguf.mapped_files import reads_checked
    from llamatrain.memory import out_of_memory_in

    with out_of_memory_in(**EXPORTING), reads_checked():
        _export(args)
    return 0


def _export(args: argparse.Namespace) -> None:
    """``export``'s file or folder written, and said."""
    from llamatrain import api

    if args.adapter:
        if args.type not in ("f32", AUTO_EXPORT_TYPE):
            raise ConfigError("--adapter writes the adapter in float32; drop --type")
        path = api.export_adapter(args.checkpoint, args.output, format=args.format)
        if args.format == "hf":
            print(f"wrote {path}/ (PEFT adapter folder, float32)")
        else:
            print(f"wrote {path} ({path.stat().st_size:,} bytes, LoRA adapter, f32)")
        return
    path = api.export(args.checkpoint, args.output, type=args.type, format=args.format)
    if args.format == "hf":
        print(f"wrote {path}/ (HF checkpoint folder, float32)")
        return
    chosen = args.type
    if chosen == AUTO_EXPORT_TYPE:  # what api.export chose
        from llamatrain.model_source import export_type_of

        chosen = export_type_of(args.checkpoint)
    print(f"wrote {path} ({path.stat().st_size:,} bytes, {chosen})")


def cmd_info(args: argparse.Namespace) -> int:
    from llamatrain import api
    from llamatrain.gguf.file import STATE_SHA256_KEY, nonfinite_tensors, read_gguf_metadata

    print(api.describe_gguf(args.file))
    if args.verify:
        checked = api.verify_gguf(args.file)  # a damaged tensor raises: one line, exit 1
        state = STATE_SHA256_KEY in read_gguf_metadata(args.file)  # since checkpoint version 2
        bad = nonfinite_tensors(args.file)
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise GGUFError(
                f"{args.file}: tensor {bad[0]}{more} holds NaN or infinite values (a diverged "
                "run, or damage); use an earlier checkpoint or lower optim.lr"
            )
        print(
            f"verify: every value finite; {'the training.*/optimizer.* keys and ' * state}all "
            f"{checked} tensors match their sha256"
            if checked
            else "verify: no sha256 recorded (only checkpoints carry them); every tensor read, "
            "every value finite"
        )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from llamatrain.plot import plot_metrics

    path = plot_metrics(args.run_dir, args.output)
    print(f"wrote {path}")
    return 0


def _add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-tokens, llama.cpp's sampler flags with SamplingParams' defaults, and --seed."""
    parser.add_argument("--max-tokens", type=int, default=128)
    for f in fields(SamplingParams):  # llama.cpp's flag names, SamplingParams' defaults
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=float if "float" in f.type else int, default=f.default)
    parser.add_argument("--seed", type=int, default=None)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--lora and --dequantize: how generate, chat and eval build the model they are given."""
    parser.add_argument(
        "--lora",
        metavar="ADAPTER",
        default=None,
        help="a LoRA adapter GGUF to apply over the model, unmerged (as llama-cli's --lora; "
        "a LoRA run folder applies its own)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="widen every weight to float32 (an adapter merged in) rather than compute over "
        "the weights as the file stores them: 4 bytes a weight, the model its f32 export holds",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamatrain", description="Train llama models in PyTorch; run them in llama.cpp."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    fit = sub.add_parser("fit", help="train a model from a TOML config")
    fit.add_argument(
        "--config",
        help="TOML config file, or a built-in config's name: tiny, shakespeare, ggml-2023 "
        "(default: the built-in defaults)",
    )
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
    fit.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in an output.dir that holds one, moving the old run aside to "
        "<output.dir>.old-<n> (nothing is deleted)",
    )
    fit.set_defaults(func=cmd_fit)

    gen = sub.add_parser("generate", help="sample text from a checkpoint or GGUF model")
    gen.add_argument("checkpoint")
    gen.add_argument("--prompt", default="")
    gen.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="reply to one user message, rendered with the model's chat template, up to the "
        "end of the assistant's turn (instead of continuing --prompt)",
    )
    gen.add_argument(
        "--chat-template",
        default="auto",
        metavar="NAME",
        help="for --chat: auto (the model's own), chatml, llama-3, llama-2 or a Jinja file",
    )
    _add_model_arguments(gen)
    _add_sampler_arguments(gen)
    gen.add_argument(
        "--seen-tokens-only",
        action="store_true",
        help="draw only tokens that occur in the run's training data (needs a checkpoint)",
    )
    gen.set_defaults(func=cmd_generate)

    talk = sub.add_parser(
        "chat", help="talk to a model over several turns (a user turn a line of input)"
    )
    talk.add_argument("checkpoint", help="run folder, checkpoint, GGUF model or HF folder")
    talk.add_argument("--system", default=None, help="a system prompt for the conversation")
    talk.add_argument(
        "--chat-template",
        default="auto",
        metavar="NAME",
        help="auto (the model's own, default), chatml, llama-3, llama-2 or a Jinja file",
    )
    _add_model_arguments(talk)
    _add_sampler_arguments(talk)
    talk.set_defaults(func=cmd_chat)

    ev = sub.add_parser("eval", help="perplexity of a model on a text file")
    ev.add_argument("checkpoint")
    ev.add_argument("--data", required=True, help="text file to score")
    ev.add_argument("--n-ctx", type=int, default=None, help="chunk size (default: model's)")
    _add_model_arguments(ev)
    ev.set_defaults(func=cmd_eval)

    ex = sub.add_parser(
        "export", help="write a llama.cpp model GGUF (or an HF folder) from a checkpoint"
    )
    ex.add_argument("checkpoint", help="run folder, checkpoint, GGUF model or HF folder")
    ex.add_argument("-o", "--output", required=True)
    ex.add_argument(
        "--format",
        default="gguf",
        help="gguf (default): a model llama.cpp runs; hf: an HF checkpoint folder "
        "(config.json, float32 model.safetensors, tokenizer files) transformers loads",
    )
    ex.add_argument(
        "--type",
        choices=RUN_EXPORT_TYPES,
        default=AUTO_EXPORT_TYPE,
        metavar="TYPE",
        help=f"{', '.join(EXPORT_TYPES)}, or through llama.cpp's quantizer (pip install "
        f"'llamatrain[quantize]') {', '.join(QUANTIZER_TYPES)}; default auto: a run's as its "
        "own export chose (q8_0 over a quantized base, the base's float type, f32 for a model "
        "trained whole), f32 for a model file or HF folder",
    )
    ex.add_argument(
        "--adapter",
        action="store_true",
        help="write a LoRA run's adapter instead of the model with the adapter merged in: "
        "llama.cpp's --lora file (f32), or with --format hf a PEFT adapter folder",
    )
    ex.set_defaults(func=cmd_export)

    info = sub.add_parser("info", help="describe a GGUF file")
    info.add_argument("file")
    info.add_argument(
        "--verify",
        action="store_true",
        help="check every tensor against the sha256 a checkpoint recorded when it was saved",
    )
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
    except OSError as err:  # a path the user named cannot be read or written
        if args.debug:
            raise
        where = f" {shown(str(err.filename), None)}" if err.filename else ""
        print(
            f"llamatrain: error: cannot use{where}: {shown(str(err.strerror or err), None)}; "
            "check the path and its permissions",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("llamatrain: interrupted", file=sys.stderr)
        return 130


def _one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line=None
) -> str:
    """Warnings as the CLI's other messages look: one line, no Python source, and what they
    quote of files and data escaped as errors' is (:func:`shown`)."""
    return f"llamatrain: warning: {shown(str(message), None)}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # a command's user sees no source lines
    args = build_parser().parse_args(argv)
    return run(args.func, args)

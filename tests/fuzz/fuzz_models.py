"""Small valid files of every kind llamatrain writes, for the fuzz targets to damage.

Random models of each family (tiny, so a case costs milliseconds) with a byte-level BPE or a
sentencepiece vocabulary, exported f32 / f16 / q8_0; a LoRA adapter over one; and the
checkpoints of real runs of the built-in ``tiny`` config (a full finetune and a LoRA run over
it), made once per session as ``tests/integration/test_run_safety.py`` makes its quick runs.
"""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import torch
from random_models import move_off_neutral, randomly_adapted

from llamatrain import api
from llamatrain.gguf.adapter import write_lora_adapter
from llamatrain.gguf.llama import write_model, write_vocab
from llamatrain.lora import lora_state_dict
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    BpeTokenizer,
    SpmTokenizer,
    Tokenizer,
)
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

SPACE = "\u2581"
SHAPE = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
FAMILIES = {
    "llama": dict(arch="llama", rope_freq_factors=True, attention_bias=True),
    "qwen2": dict(arch="qwen2", tie_embeddings=True),
    "qwen3": dict(arch="qwen3", key_length=32),
    "smollm3": dict(arch="smollm3", rope_theta=2e6),
    "gemma3": dict(arch="gemma3", sliding_window=8, rope_theta_swa=500.0, tie_embeddings=True),
}
EXPORT_TYPES = ("f32", "f16", "q8_0")
TEXT = "hello <s> world, the <|begin|> 12345 \u00e9t\u00e9\n"
QUICK = {
    "train.steps": 2,
    "train.save_every": 2,
    "train.eval_every": 0,
    "train.sample_tokens": 0,
    "train.n_batch": 64,
    "train.n_ubatch": 64,
    "output.export": "false",
}


def bpe_tokenizer() -> BpeTokenizer:
    """Byte-level BPE: the 256 byte tokens, two merges and two control tokens."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["\u0120t", "he", "<|begin|>", "<|end|>"]
    types = [TOKEN_TYPE_NORMAL] * 258 + [TOKEN_TYPE_CONTROL] * 2
    return BpeTokenizer(tokens, types, ["\u0120 t", "h e"], pre="llama-bpe", bos_id=258, eos_id=259)


def spm_tokenizer() -> SpmTokenizer:
    """Sentencepiece: unk/bos/eos, the 256 byte pieces and a few merged pieces."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [SPACE, "h", "e", "l", "o", "he", "ll", SPACE + "he", "llo"]
    types = [2, 3, 3, *[6] * 256, *[1] * 9]
    return SpmTokenizer(pieces, [-float(i) for i in range(len(pieces))], types)


def family_model(arch: str, tokenizer: Tokenizer, seed: int = 0, **changes: object) -> Llama:
    """A random model of the family ``arch`` (``changes``: to its config)."""
    torch.manual_seed(seed)
    fields = {**SHAPE, **FAMILIES[arch], **changes}
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **fields)
    return move_off_neutral(Llama(cfg)).eval()


def write_exports(folder: Path) -> dict[str, Path]:
    """``<family>-<type>.gguf`` for every family and export type (llama with sentencepiece,
    the others byte-level BPE), and ``lora-<family>.gguf``: an adapter over each."""
    files = {}
    for arch in FAMILIES:
        tokenizer = spm_tokenizer() if arch == "llama" else bpe_tokenizer()
        model = family_model(arch, tokenizer)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        for kind in EXPORT_TYPES:
            path = folder / f"{arch}-{kind}.gguf"
            files[path.stem] = write_model(path, model.cfg, state, tokenizer, type=kind)
        adapted = randomly_adapted(model, 2, 4.0, std_a=0.1, std_b=0.1)
        path = folder / f"lora-{arch}.gguf"
        files[path.stem] = write_lora_adapter(
            path, lora_state_dict(adapted), alpha=4.0, base_architecture=arch
        )
    return files


@functools.cache
def base_files(folder: Path, cache_dir: Path) -> dict[str, Path]:
    """Every file of :func:`write_exports` and :func:`quick_runs` (``checkpoint-full``,
    ``checkpoint-lora``), made once per session (the fuzz targets share them), and read once:
    the first load in a process sets up for seconds, which is no case's time."""
    folder.mkdir(parents=True, exist_ok=True)
    files = write_exports(folder)
    files |= {f"checkpoint-{k}": v for k, v in quick_runs(folder / "runs", cache_dir).items()}
    for name in ("llama-q8_0", "checkpoint-lora"):
        api.load(files[name])
    return files


def quick_runs(folder: Path, cache_dir: Path) -> dict[str, Path]:
    """The latest checkpoints of two steps of the tiny config (``full``) and of a LoRA run over
    its checkpoint (``lora``, which records that base)."""

    vocab = write_vocab(folder / "vocab.gguf", bpe_tokenizer())  # no tokenizer to train

    def run(name: str, **extra: object) -> Path:
        values = {
            "data.cache_dir": f'"{cache_dir}"',
            "output.dir": f'"{folder / name}"',
            "tokenizer.path": f'"{vocab}"',
        }
        overrides = [f"{k}={v}" for k, v in {**values, **QUICK, **extra}.items()]
        with mock.patch.object(api, "can_plot", lambda: False):  # curves.png: seconds, unused
            done = api.fit("tiny", overrides=overrides, progress=False)
        return (done.run_dir / "checkpoints" / "latest.gguf").resolve()

    full = run("full")
    return {"full": full, "lora": run("lora", **{"lora.rank": 2, "model.init_from": f'"{full}"'})}

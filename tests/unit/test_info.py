"""``llamatrain info``: a short, complete description of models, checkpoints and vocabularies."""

from pathlib import Path

import pytest

from llamatrain import api
from llamatrain.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> api.FitResult:
    """configs/tiny.toml for 4 steps: an exported model and a checkpoint to describe."""
    run = tmp_path_factory.mktemp("info") / "run"
    cache = tmp_path_factory.mktemp("info-cache")
    overrides = [
        f'data.path="{REPO / "tests" / "data" / "tiny.txt"}"',
        f'data.cache_dir="{cache}"',
        f'output.dir="{run}"',
        "train.steps=4", "train.save_every=0", "train.eval_every=0", "train.eval_batches=1",
        "train.sample_tokens=4", "train.log_every=2",
    ]  # fmt: skip
    return api.fit(REPO / "configs" / "tiny.toml", overrides=overrides, progress=False)


def test_model_description(short_run):
    text = api.describe_gguf(short_run.export_path)
    head = text.splitlines()[0]
    assert "llama model" in head and "21 tensors" in head
    for expected in (
        "general.architecture: llama",
        "hyper-parameters:",
        "llama.block_count: 2",
        "llama.attention.head_count_kv: 2",
        "tokenizer: model 'llama'; 384 tokens",
        "bos 1 '<s>'; eos 2 '</s>'",
        "add_bos_token true",
    ):
        assert expected in text, expected
    assert "tokenizer.ggml.tokens" not in text  # summarised, not dumped
    assert "training counters" not in text
    table = text[text.index("tensors (21):") :].splitlines()
    assert table[1].split() == ["name", "shape", "type", "bytes"]
    row = next(line for line in table if line.split()[0] == "token_embd.weight")
    assert row.split()[1:] == ["384x64", "F32", f"{384 * 64 * 4:,}"]
    assert table[-1].split()[0] == "total"


def test_checkpoint_description_has_training_counters(short_run):
    ckpt = short_run.run_dir / "checkpoints" / "latest.gguf"
    text = api.describe_gguf(ckpt)
    assert "llama training checkpoint" in text.splitlines()[0]
    assert "training counters:" in text and "training.iteration_count: 4" in text
    assert "training.token_count: 2048" in text  # 4 steps x 512 tokens
    assert "optimizer:" in text and "optimizer.adam.first_moments" in text
    assert "training.rng_state" not in text  # raw bytes are not for reading


def test_cli_info_and_the_fit_curves(short_run, capsys):
    assert main(["info", str(short_run.export_path)]) == 0
    assert "llama.embedding_length: 64" in capsys.readouterr().out
    # fit draws curves.png into the run folder whenever matplotlib is installed
    if short_run.curves_path is not None:
        assert short_run.curves_path == short_run.run_dir / "curves.png"
        assert short_run.curves_path.read_bytes()[:4] == b"\x89PNG"

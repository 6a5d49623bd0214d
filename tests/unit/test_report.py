"""The end-of-run report: its memory split adds up, and each part is what the tensors hold."""

import dataclasses

import torch

from llamatrain.config import OptimSection
from llamatrain.model import Llama, ModelConfig
from llamatrain.optim import build_optimizer
from llamatrain.report import RunPlan, measure, peak_memory


def test_memory_split_adds_up_to_the_peak_and_counts_the_tensors():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
    model = Llama(cfg)
    optimizer = build_optimizer(model, OptimSection())
    tokens = torch.randint(0, 64, (2, 17))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    report = measure(
        model, optimizer, torch.device("cpu"), steps=1, seconds=0.5, tokens=32, checkpoint_segment=0
    )
    weights = 4 * model.num_params()  # float32
    assert report.weights_bytes == weights
    assert report.gradients_bytes == weights  # every parameter trains
    n_tensors = len(list(model.parameters()))
    # AdamW: two moments per parameter plus one float32 step counter per tensor.
    assert report.optimizer_bytes == 2 * weights + 4 * n_tensors
    parts = report.weights_bytes + report.gradients_bytes + report.optimizer_bytes
    assert parts + report.rest_bytes == report.peak_bytes  # exact: "rest" is the remainder
    assert report.rest_bytes > 0  # the process (PyTorch itself) is larger than this model
    assert report.peak_bytes <= peak_memory(torch.device("cpu"))[0]
    assert report.to_dict()["rest_bytes"] == report.rest_bytes


def test_report_lines_say_time_rate_memory_and_checkpointing():
    report = measure(
        Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=8, max_seq_len=4)),
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]),
        torch.device("cpu"),
        steps=10,
        seconds=2.0,
        tokens=10_240,
        checkpoint_segment=2,
    )
    text = "\n".join(report.lines())
    assert "trained 10 steps in 2.0 s (0.200 s/step, 5,120 tokens/s)" in text
    assert "peak memory" in text and "(peak RSS)" in text and "optimizer state" in text
    assert "activation checkpointing: every 2 block(s)" in text
    off = dataclasses.replace(report, checkpoint_segment=0)
    assert off.lines()[-1] == "activation checkpointing: off"


def test_the_opening_summarys_epochs_count_what_people_count():
    """Issue 37, item 8: a stream's training windows may start at every line, so they overlap
    (here ~12 tokens apart); 'epochs' over windows said 0.01 of a run reading 0.6 of its text
    once. Epochs are tokens read over the training tokens; for examples, rows over rows."""
    stream = RunPlan(
        model="llama", params=1, trained=1, device="cpu", dtype="float32",
        stream_tokens=110_000, train_rows=8_000, val_rows=156, n_ctx=64, seqs_per_step=16,
        micro_batches=1, steps=62, done=2, run_dir="run",
    )  # fmt: skip
    assert abs(stream.epochs - 0.614) < 1e-3  # 60 x 16 x 64 = 61,440 of 100,016 tokens
    assert "about 0.61 epochs" in stream.lines()[2]
    rows = dataclasses.replace(stream, stream_tokens=None, train_rows=480)
    assert rows.epochs == 2.0

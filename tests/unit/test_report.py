"""The end-of-run report: its memory split adds up, and each part is what the tensors hold."""

import dataclasses

import torch

from llamatrain.config import OptimSection
from llamatrain.model import Llama, ModelConfig
from llamatrain.optim import build_optimizer
from llamatrain.report import measure, peak_memory


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

"""Training curves: ``llamatrain.plot.plot_metrics`` and ``llamatrain plot``."""

import functools
import json
import struct
import sys
from pathlib import Path

import pytest

from llamatrain.cli import main
from llamatrain.errors import LlamatrainError
from llamatrain.plot import can_plot, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run: Path, *, resumed: bool = True, truncated: bool = True) -> Path:
    """A metrics.jsonl as the trainer writes it: train lines, eval lines, a resume, a torn tail."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(10, 101, 10):
        lines.append({"step": step, "loss": 6.0 - step / 40, "lr": 1e-3 * step / 100,
                      "tokens_per_s": 1000.0})  # fmt: skip
        if step % 50 == 0:
            val = 6.1 - step / 40
            lines.append({"step": step, "val_loss": val, "val_ppl": 2.718281828**val,
                          "val_acc": step / 400, "sample": "Romeo. O"})  # fmt: skip
    if resumed:  # resumed from the step-50 checkpoint: steps 60.. are written again
        lines.append({"step": 60, "loss": 1.25, "lr": 6e-4, "tokens_per_s": 900.0})
    text = "\n".join(json.dumps(r) for r in lines) + "\n"
    if truncated:
        text += '{"step": 110, "loss": 3.'  # the trainer is writing this line right now
    path = run / "metrics.jsonl"
    path.write_text(text)
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_next_to_the_metrics(tmp_path):
    run = tmp_path / "run"
    write_metrics(run)
    out = plot_metrics(run)
    assert out == run / "curves.png"
    width, height = png_size(out)
    assert (width, height) == (1300, 400)  # 13x4 inches at 100 dpi: three readable panels
    assert out.stat().st_size > 20_000  # curves, labels and legends, not an empty canvas


def test_plot_to_an_explicit_path_and_from_the_file_itself(tmp_path):
    metrics = write_metrics(tmp_path / "run", truncated=False)
    out = plot_metrics(metrics, tmp_path / "pics" / "a.png")
    assert out == tmp_path / "pics" / "a.png" and png_size(out)[0] == 1300


def test_read_metrics_splits_sorts_and_lets_a_resume_win(tmp_path):
    train, evals = read_metrics(write_metrics(tmp_path / "run"))
    assert [r["step"] for r in train] == list(range(10, 101, 10))
    assert next(r for r in train if r["step"] == 60)["loss"] == 1.25  # the later line wins
    assert [r["step"] for r in evals] == [50, 100]


def test_plot_without_evaluations(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0, "lr": 1e-3}) + "\n")
    assert png_size(plot_metrics(run)) == (1300, 400)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "no metrics.jsonl"),
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("")), "no metrics yet"),
        # damaged lines are skipped with a warning (test_logs_are_data): none left is no metrics
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("oops\n{}\n")), "no metrics yet"),
    ],
)
def test_errors_name_the_problem(tmp_path, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(LlamatrainError, match=message):
        plot_metrics(run)


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    write_metrics(tmp_path / "run")
    assert can_plot()  # the test extra installs matplotlib: these tests never skip
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises
    assert not can_plot()
    with pytest.raises(LlamatrainError, match=r"pip install 'llamatrain\[plot\]'"):
        plot_metrics(tmp_path / "run")


def test_fit_skips_curves_without_matplotlib(tmp_path, monkeypatch):
    """Curves are a convenience: a finished run without matplotlib has no picture, no error."""
    from llamatrain import api

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises
    result = api.fit(
        "tiny",
        overrides=[f"output.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"],
        progress=False,
        train__steps=2,
        train__eval_every=0,
        output__export=False,
    )
    assert result.curves_path is None
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert not (tmp_path / "run" / "curves.png").exists()


def test_cli_plot(tmp_path, capsys):
    write_metrics(tmp_path / "run")
    out = tmp_path / "c.png"
    assert main(["plot", str(tmp_path / "run"), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert png_size(out) == (1300, 400)
    assert main(["plot", str(tmp_path / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err


def write_preference_metrics(run: Path) -> Path:
    """A DPO run's metrics.jsonl: train lines with the reward metrics, one evaluation."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, 9):
        lines.append({"step": step, "loss": 0.69 - step / 20, "lr": 1e-3, "tokens_per_s": 1.0,
                      "reward_margin": step / 10, "reward_accuracy": min(1.0, step / 4),
                      "reward_chosen": step / 20, "reward_rejected": -step / 20,
                      "logp_chosen": -20 + step, "logp_rejected": -40 - step})  # fmt: skip
    lines.append({"step": 8, "val_loss": 0.3, "val_reward_margin": 0.7,
                  "val_reward_accuracy": 1.0})  # fmt: skip
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_a_preference_run_plots_its_reward_margin_and_accuracy(tmp_path):
    from llamatrain.plot import metrics_figure

    train, evals = read_metrics(write_preference_metrics(tmp_path / "run"))
    fig = metrics_figure(train, evals, "run")
    panels = {ax.get_title(): ax for ax in fig.axes}
    margin = panels["Reward margin (chosen - rejected)"]
    accuracy = panels["Reward accuracy (chosen > rejected)"]
    train_line, val_line = margin.lines[0], margin.lines[1]
    assert list(train_line.get_ydata()) == [s / 10 for s in range(1, 9)]
    assert list(val_line.get_xdata()) == [8] and list(val_line.get_ydata()) == [0.7]
    assert list(accuracy.lines[0].get_ydata())[-1] == 1.0
    assert "Validation perplexity" not in panels and "Policy log-probs of the replies" in panels
    out = plot_metrics(tmp_path / "run")
    assert png_size(out) == (1300, 800)  # 2x3 panels
    sft = metrics_figure(*read_metrics(write_metrics(tmp_path / "sft")), "sft")
    assert [ax.get_title() for ax in sft.axes][2] == "Validation perplexity"  # SFT unchanged


def write_grpo_metrics(run: Path) -> Path:
    """A GRPO run's metrics.jsonl, keys as the trainer logs them (TRL's names): 6 steps with
    two reward functions and β > 0, held-out greedy evaluations (no val_loss) at 3 and 6."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, 7):
        lines.append({
            "step": step, "loss": 0.001 * step, "lr": 1e-3, "tokens_per_s": 10.0,
            "grad_norm": 0.5, "reward": step / 6, "reward_std": 0.1 * step,
            "rewards/correct/mean": step / 12, "rewards/correct/std": 0.3,
            "rewards/length/mean": 0.5, "rewards/length/std": 0.1,
            "frac_reward_zero_std": 0.25, "completions/mean_length": 10.0 + step,
            "completions/min_length": 4.0, "completions/max_length": 16.0 + step,
            "completions/clipped_ratio": 0.5, "completions/mean_terminated_length": 9.0,
            "completions/min_terminated_length": 4.0, "completions/max_terminated_length": 12.0,
            "kl": 0.001 * step, "entropy": 2.0 - step / 10, "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0, "rollout_s": 1.0,
        })  # fmt: skip
        if step % 3 == 0:
            lines.append({
                "step": step, "val_reward": step / 10, "val_reward_std": 0.2,
                "val_rewards/correct/mean": step / 10, "val_rewards/correct/std": 0.4,
                "val_rewards/length/mean": 0.4, "val_rewards/length/std": 0.1,
                "val_completions/mean_length": 8.0, "val_completions/clipped_ratio": 0.0,
            })  # fmt: skip
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def panel_lines(panels: dict, title: str) -> dict[str, tuple[list, list]]:
    """Each line of the panel ``title``: its label → (x, y)."""
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in panels[title].lines
    }


def test_a_grpo_run_plots_its_rewards_lengths_and_entropy(tmp_path):
    from llamatrain.plot import metrics_figure

    train, evals = read_metrics(write_grpo_metrics(tmp_path / "run"))
    assert [r["step"] for r in evals] == [3, 6]  # evaluations without a val_loss are kept
    fig = metrics_figure(train, evals, "run")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(panels) == {
        "Loss", "Learning rate", "Reward", "Reward per function", "Completion length",
        "Entropy and KL",
    }  # fmt: skip
    steps = list(range(1, 7))
    lines = functools.partial(panel_lines, panels)
    reward = lines("Reward")
    assert reward["train reward (mean)"] == (steps, [s / 6 for s in steps])
    assert reward["held-out reward (greedy)"] == ([3, 6], [0.3, 0.6])
    (band,) = panels["Reward"].collections  # mean ± std
    vertices = band.get_paths()[0].vertices
    for step in steps:
        at = vertices[vertices[:, 0] == step, 1]
        assert min(at) == pytest.approx(step / 6 - 0.1 * step)
        assert max(at) == pytest.approx(step / 6 + 0.1 * step)
    functions = lines("Reward per function")
    assert functions["train correct"] == (steps, [s / 12 for s in steps])
    assert functions["validation correct"] == ([3, 6], [0.3, 0.6])
    assert functions["train length"][1] == [0.5] * 6
    length = lines("Completion length")
    assert length["train mean length"][1] == [10.0 + s for s in steps]
    assert length["train min length"][1] == [4.0] * 6
    assert length["train max length"][1] == [16.0 + s for s in steps]
    assert length["validation mean length"] == ([3, 6], [8.0, 8.0])
    assert lines("Entropy and KL")["entropy"][1] == pytest.approx([2.0 - s / 10 for s in steps])
    (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "KL (nats/token)"]
    assert list(twin.lines[0].get_ydata()) == pytest.approx([0.001 * s for s in steps])
    assert png_size(plot_metrics(tmp_path / "run")) == (1300, 800)


def test_a_grpo_run_with_tools_adds_the_tool_panels(tmp_path):
    from llamatrain.plot import metrics_figure

    path = write_grpo_metrics(tmp_path / "run")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if "loss" in record:
            s = record["step"]
            record |= {
                "tools/call_frequency": s / 2, "tools/failure_frequency": 1 / s,
                "tools/turns": 1 + s / 2, "tools/failures/unknown_tool": 0.5,
                "tools/failures/timed_out": s / 10,
            }  # fmt: skip
        else:
            record |= {"val_tools/call_frequency": 2.0, "val_tools/failure_frequency": 0.0}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = metrics_figure(*read_metrics(path), "run")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert {"Tool calls", "Failed calls by kind", "Failed calls", "Reward"} <= set(panels)
    steps = list(range(1, 7))
    lines = functools.partial(panel_lines, panels)
    calls = lines("Tool calls")
    assert calls["train calls"] == (steps, [s / 2 for s in steps])
    assert calls["validation calls"] == ([3, 6], [2.0, 2.0])
    assert calls["train turns"][1] == [1 + s / 2 for s in steps]
    kinds = lines("Failed calls by kind")
    assert kinds["unknown_tool"][1] == [0.5] * 6
    assert kinds["timed_out"][1] == pytest.approx([s / 10 for s in steps])
    assert lines("Failed calls")["train failed share"][1] == pytest.approx([1 / s for s in steps])
    assert png_size(plot_metrics(tmp_path / "run")) == (1300, 1200)

"""Training curves from a run's ``metrics.jsonl``, drawn to a PNG.

The trainer appends one JSON object per line: training lines ``{step, loss, lr,
tokens_per_s}`` and evaluation lines ``{step, val_loss, val_ppl, val_acc, sample}``; a
preference run's lines add ``reward_margin``, ``reward_accuracy``, ``reward_chosen``,
``reward_rejected``, ``logp_chosen`` and ``logp_rejected`` (``val_`` ones in evaluations),
and its plot gets panels for them in place of perplexity. This
module reads that file (nothing else), so a run can be plotted while it trains, after it
finished, or on another machine with only the file copied over.

matplotlib is an optional extra (``pip install 'llamatrain[plot]'``): training must not
depend on a plotting stack, so it is imported only when a plot is asked for. Drawing goes
through ``matplotlib.figure.Figure`` directly, not ``pyplot``, so plotting never changes the
global backend or leaks figures into a notebook that is also showing its own plots.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llamatrain.errors import LlamatrainError
from llamatrain.files import written_atomically

__all__ = [
    "METRICS_FILE",
    "CURVES_FILE",
    "can_plot",
    "metrics_figure",
    "plot_metrics",
    "read_metrics",
    "read_records",
]

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"

_INSTALL_HINT = "pip install 'llamatrain[plot]' (or pip install matplotlib)"


def _metrics_path(run: str | Path) -> Path:
    """``run`` may be a run folder or the metrics file itself (e.g. a copied one)."""
    path = Path(run)
    if path.is_file():
        return path
    if not path.exists():
        raise LlamatrainError(f"run folder {path} does not exist; pass a folder from `fit`")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise LlamatrainError(
            f"{path} has no {METRICS_FILE}; is it a run folder (output.dir of a `fit`)? "
            "Training writes the file at its first log_every step"
        )
    return metrics


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in file order.

    A torn last line is skipped: the trainer may be writing it right now, or a crash (a
    SIGKILL, a full disk) cut it; the records before it are whole, because each line is
    written at once. Any other line that is not a record with an integer ``step`` is an error.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                continue
            raise LlamatrainError(
                f"{path}:{number} is not a JSON line ({e}); delete that line or the file"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise LlamatrainError(f"{path}:{number} is not a metrics record with a 'step'")
        records.append(record)
    return records


def read_metrics(run: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The (training, evaluation) records of a run, each sorted by step.

    A resumed run appends to the same file; when it resumed from an older checkpoint some
    steps appear twice, and the later line (the run that continued) wins.
    """
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for record in read_records(_metrics_path(run)):
        if "loss" in record:
            train[record["step"]] = record
        elif "val_loss" in record:
            evals[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key`` (a NaN loss would blank a whole log-scale axis)."""
    pairs = [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def can_plot() -> bool:
    """Whether matplotlib (the optional ``[plot]`` extra) can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


PREFERENCE_KEYS = ("reward_margin", "reward_accuracy")
"""A run that logged these is a preference run: its plot shows its rewards."""


def _train_and_val(ax: Any, train: list, evals: list, key: str, color: str, label: str) -> None:
    """``key`` of the training lines and ``val_`` + ``key`` of the evaluations on ``ax``."""
    steps, values = _series(train, key)
    ax.plot(steps, values, color=color, linewidth=1.2, label=f"train {label}")
    steps, values = _series(evals, f"val_{key}")
    ax.plot(steps, values, "o--", color=color, linewidth=1.2, label=f"validation {label}")


def _preference_panels(axes: Any, train: list, evals: list) -> None:
    """Reward margin, reward accuracy, and the chosen/rejected log-probs and rewards."""
    margin_ax, acc_ax, logp_ax, reward_ax = axes
    _train_and_val(margin_ax, train, evals, "reward_margin", "tab:purple", "margin")
    margin_ax.axhline(0, color="gray", linewidth=0.8)
    margin_ax.set(title="Reward margin (chosen - rejected)", xlabel="optimizer step",
                  ylabel="reward")  # fmt: skip
    _train_and_val(acc_ax, train, evals, "reward_accuracy", "tab:olive", "accuracy")
    acc_ax.set(title="Reward accuracy (chosen > rejected)", xlabel="optimizer step",
               ylabel="share of pairs", ylim=(-0.05, 1.05))  # fmt: skip
    for kind, color in (("chosen", "tab:green"), ("rejected", "tab:red")):
        _train_and_val(logp_ax, train, evals, f"logp_{kind}", color, kind)
        _train_and_val(reward_ax, train, evals, f"reward_{kind}", color, kind)
    logp_ax.set(title="Policy log-probs of the replies", xlabel="optimizer step",
                ylabel="log-prob (sum, or per-token mean)")  # fmt: skip
    reward_ax.set(title="Rewards", xlabel="optimizer step", ylabel="reward")


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train and validation), learning rate and validation perplexity to a PNG;
    for a preference run (one that logged reward metrics), the reward margin, the reward
    accuracy, the replies' log-probs and the rewards in place of perplexity.

    ``run_dir`` is a run folder (or its ``metrics.jsonl``); ``out`` defaults to
    ``<run_dir>/curves.png``. Returns the path written. Raises ``LlamatrainError`` when the
    file is missing or empty, or when matplotlib is not installed.
    """
    path = _metrics_path(run_dir)
    train, evals = read_metrics(path)
    if not train and not evals:
        raise LlamatrainError(f"{path} holds no metrics yet; train for log_every steps first")
    if not can_plot():
        raise LlamatrainError(f"plotting needs matplotlib: {_INSTALL_HINT}")
    out = Path(out) if out is not None else path.parent / CURVES_FILE
    title = path.parent.name if path.name == METRICS_FILE else path.name
    fig = metrics_figure(train, evals, title)
    with written_atomically(out, "plot") as tmp:
        fig.savefig(tmp, dpi=100, format=out.suffix.lstrip(".") or "png")
    return out


def metrics_figure(train: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> Any:
    """The figure :func:`plot_metrics` draws (a ``matplotlib.figure.Figure``): 1x3 panels,
    or 2x3 for a preference run."""
    from matplotlib.figure import Figure

    preference = any(key in r for r in train + evals for key in PREFERENCE_KEYS)
    if preference:
        fig = Figure(figsize=(13, 8), layout="constrained")
        (loss_ax, lr_ax, margin_ax), (acc_ax, logp_ax, reward_ax) = fig.subplots(2, 3)
        extra = [margin_ax, acc_ax, logp_ax, reward_ax]
        _preference_panels(extra, train, evals)
    else:
        fig = Figure(figsize=(13, 4), layout="constrained")
        loss_ax, lr_ax, ppl_ax = fig.subplots(1, 3)
        extra = [ppl_ax]
    fig.suptitle(f"llamatrain run: {title}", fontweight="bold")

    steps, loss = _series(train, "loss")
    loss_ax.plot(steps, loss, color="tab:blue", linewidth=1.2, label="train loss")
    steps, val = _series(evals, "val_loss")
    loss_ax.plot(steps, val, "o-", color="tab:orange", linewidth=1.5, label="validation loss")
    loss_label = "preference loss (per pair)" if preference else "cross-entropy (nats/token)"
    loss_ax.set(title="Loss", xlabel="optimizer step", ylabel=loss_label)

    steps, lr = _series(train, "lr")
    lr_ax.plot(steps, lr, color="tab:green", label="learning rate")
    lr_ax.set(title="Learning rate", xlabel="optimizer step", ylabel="lr")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))

    if not preference:
        _perplexity_panel(ppl_ax, evals)

    for ax in (loss_ax, lr_ax, *extra):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    return fig


def _perplexity_panel(ppl_ax: Any, evals: list) -> None:
    steps, ppl = _series(evals, "val_ppl")
    ppl_ax.plot(steps, ppl, "o-", color="tab:red", label="validation perplexity")
    ppl_ax.set(title="Validation perplexity", xlabel="optimizer step", ylabel="perplexity")
    if ppl and min(ppl) > 0 and max(ppl) / min(ppl) > 10:
        ppl_ax.set_yscale("log")  # early perplexities are near the vocab size, late ones small
    if not ppl:
        ppl_ax.text(
            0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ppl_ax.transAxes
        )

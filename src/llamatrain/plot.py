"""Training curves from a run's ``metrics.jsonl``, drawn to a PNG.

The trainer appends one JSON object per line: training lines ``{step, loss, lr,
tokens_per_s}`` and evaluation lines ``{step, val_loss, val_ppl, val_acc, sample}``; a
preference run's lines add ``reward_margin``, ``reward_accuracy``, ``reward_chosen``,
``reward_rejected``, ``logp_chosen`` and ``logp_rejected`` (``val_`` ones in evaluations),
and its plot gets panels for them in place of perplexity. A GRPO run's lines carry TRL's
names (``reward``, ``reward_std``, ``rewards/<function>/mean``, ``completions/mean_length``
(``min_``, ``max_``), ``entropy``, ``kl``), its evaluations the held-out greedy reward
(``val_reward``, ``val_rewards/<function>/mean``, no ``val_loss``), and its plot shows the
reward (mean ± std), each function's reward, the completion lengths and the entropy and KL; one
that called tools (``tools/call_frequency``) adds a row: calls and turns per completion, failed
calls by kind, and the share of calls that failed.
This module reads that file (nothing else), so a run can be plotted while it trains, after it
finished, or on another machine with only the file copied over.

matplotlib is an optional extra (``pip install 'llamatrain[plot]'``): training must not
depend on a plotting stack, so it is imported only when a plot is asked for. Drawing goes
through ``matplotlib.figure.Figure`` directly, not ``pyplot``, so plotting never changes the
global backend or leaks figures into a notebook that is also showing its own plots.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from llamatrain.errors import LlamatrainError, LlamatrainWarning
from llamatrain.files import written_atomically
from llamatrain.numbers import finite_number

__all__ = [
    "METRICS_FILE",
    "CURVES_FILE",
    "can_plot",
    "finite_value",
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


MAX_STEP = 2**63 - 1
"""The largest step a record may name (a checkpoint's counter is an int64)."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a metrics file (or of ``completions.jsonl``), in file order.

    A log is data: a line that is not a JSON object with a ``step`` in 0..2^63-1 (cut by a
    crash, edited, a number with more digits than Python reads, nested past its recursion
    limit) is damaged and skipped, so it costs its own line, never the plot, the export or a
    resume. A torn last line is skipped silently: the trainer may be writing it right now, or
    a crash (a SIGKILL, a full disk) cut it, and the lines before it are whole because each is
    written at once; the others are counted in one warning.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records, damaged = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _record(line)
        if record is not None:
            records.append(record)
        elif number != len(lines):
            damaged.append(number)
    if damaged:
        warnings.warn(
            f"{path}: skipped {len(damaged)} damaged line(s), the first line {damaged[0]}: not "
            "a JSON object with a step (0..2^63-1)",
            LlamatrainWarning,
            stacklevel=2,
        )
    return records


def _record(line: str) -> dict[str, Any] | None:
    """The record ``line`` holds, or None when it is damaged (:func:`read_records`)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError, or an int past 4,300 digits
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if type(step) is int and 0 <= step <= MAX_STEP else None


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
        elif "val_loss" in record or "val_reward" in record:  # GRPO's evaluations have no loss
            evals[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


PLOTTABLE = 1e300
"""The largest magnitude a panel draws: matplotlib's margins and ticks around a value near
float's maximum overflow (``arange: cannot compute length``)."""


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and drawable values of ``key`` (:func:`_drawable`)."""
    pairs = [(r["step"], _drawable(finite_value(r, key))) for r in records]
    return [step for step, v in pairs if v is not None], [v for _, v in pairs if v is not None]


def _drawable(value: float | None) -> float | None:
    """``value`` when a panel can draw it: finite (a NaN loss would blank a whole log-scale
    axis) and within :data:`PLOTTABLE`."""
    return value if value is not None and abs(value) <= PLOTTABLE else None


def finite_value(record: dict[str, Any], key: str) -> float | None:
    """``record[key]`` as a finite float (``numbers.finite_number``), else None."""
    return finite_number(record.get(key))


def can_plot() -> bool:
    """Whether matplotlib (the optional ``[plot]`` extra) can be imported."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


PREFERENCE_KEYS = ("reward_margin", "reward_accuracy")
"""A run that logged these is a preference run: its plot shows its rewards."""

GRPO_KEYS = ("reward", "val_reward")
"""A run that logged these is a GRPO run: its plot shows its rewards and completion lengths."""


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


def _reward_panel(ax: Any, train: list, evals: list) -> None:
    """The step's mean reward with a band of ± its std, and the held-out greedy reward."""
    steps, mean = _series(train, "reward")
    ax.plot(steps, mean, color="tab:purple", linewidth=1.2, label="train reward (mean)")
    band = [(r["step"], *_band(r)) for r in train if _band(r) is not None]
    if band:
        steps, low, high = zip(*band, strict=True)
        ax.fill_between(steps, low, high, color="tab:purple", alpha=0.2, label="± std")
    steps, val = _series(evals, "val_reward")
    ax.plot(steps, val, "o--", color="tab:orange", linewidth=1.2, label="held-out reward (greedy)")
    ax.set(title="Reward", xlabel="optimizer step", ylabel="weighted reward")


def _band(record: dict[str, Any]) -> tuple[float, float] | None:
    """A training line's reward ± its std, or None where either bound cannot be drawn (±1e308
    overflows, a value is missing)."""
    mean, std = finite_value(record, "reward"), finite_value(record, "reward_std")
    if mean is None or std is None:
        return None
    low, high = _drawable(mean - std), _drawable(mean + std)
    return None if low is None or high is None else (low, high)


def _functions_panel(ax: Any, train: list, evals: list) -> None:
    """Each reward function's mean, on the training completions and the held-out ones."""
    for i, name in enumerate(_reward_functions(train + evals)):
        color = f"C{i % 10}"
        _train_and_val(ax, train, evals, f"rewards/{name}/mean", color, name)
    ax.set(title="Reward per function", xlabel="optimizer step", ylabel="mean reward")


def _reward_functions(records: list) -> list[str]:
    """The reward functions' names, in the order their metrics first appear."""
    names = {}
    for record in records:
        for key in record:
            name = key.removeprefix("val_")
            if name.startswith("rewards/") and name.endswith("/mean"):
                names[name[len("rewards/") : -len("/mean")]] = None
    return list(names)


def _length_panel(ax: Any, train: list, evals: list) -> None:
    """The completions' mean length, between their shortest and longest, each step."""
    _train_and_val(ax, train, evals, "completions/mean_length", "tab:blue", "mean length")
    for key, style in (("min_length", ":"), ("max_length", "--")):
        steps, values = _series(train, f"completions/{key}")
        ax.plot(steps, values, style, color="tab:blue", linewidth=1.0,
                label=f"train {key.replace('_', ' ')}")  # fmt: skip
    ax.set(title="Completion length", xlabel="optimizer step", ylabel="tokens")


def _entropy_panel(ax: Any, train: list) -> None:
    """The policy's entropy over the completion tokens, and its KL to the reference (β > 0)
    on a second axis (they differ by orders of magnitude)."""
    steps, entropy = _series(train, "entropy")
    ax.plot(steps, entropy, color="tab:green", linewidth=1.2, label="entropy")
    ax.set(title="Entropy and KL", xlabel="optimizer step", ylabel="entropy (nats/token)")
    steps, kl = _series(train, "kl")
    if kl:
        twin = ax.twinx()
        twin.plot(steps, kl, color="tab:red", linewidth=1.2, label="KL to the reference")
        twin.set_ylabel("KL (nats/token)")
        twin.legend(loc="lower right")


def _grpo_panels(axes: Any, train: list, evals: list) -> None:
    """Reward (mean ± std, held-out), reward per function, completion length, entropy/KL."""
    reward_ax, functions_ax, length_ax, entropy_ax = axes
    _reward_panel(reward_ax, train, evals)
    _functions_panel(functions_ax, train, evals)
    _length_panel(length_ax, train, evals)
    _entropy_panel(entropy_ax, train)


TOOL_KEY = "tools/call_frequency"
"""A GRPO run that logged this called tools (``train.tools``): its plot adds their panels."""


def _called_tools(records: list[dict[str, Any]]) -> bool:
    return any(TOOL_KEY in r or f"val_{TOOL_KEY}" in r for r in records)


def _tool_panels(axes: Any, train: list, evals: list) -> None:
    """Tool calls and assistant turns per completion, failed calls per completion by kind,
    and the share of calls that failed."""
    calls_ax, kinds_ax, share_ax = axes
    _train_and_val(calls_ax, train, evals, TOOL_KEY, "tab:blue", "calls")
    _train_and_val(calls_ax, train, evals, "tools/turns", "tab:gray", "turns")
    calls_ax.set(title="Tool calls", xlabel="optimizer step", ylabel="per completion")
    kinds = dict.fromkeys(
        key.removeprefix("val_").removeprefix("tools/failures/")
        for record in train + evals
        for key in record
        if key.removeprefix("val_").startswith("tools/failures/")
    )
    for i, kind in enumerate(kinds):
        steps, values = _series(train, f"tools/failures/{kind}")
        kinds_ax.plot(steps, values, color=f"C{i % 10}", linewidth=1.2, label=kind)
    kinds_ax.set(title="Failed calls by kind", xlabel="optimizer step", ylabel="per completion")
    _train_and_val(share_ax, train, evals, "tools/failure_frequency", "tab:red", "failed share")
    share_ax.set(title="Failed calls", xlabel="optimizer step", ylabel="failed / calls")


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
    2x3 for a preference or a GRPO run, 3x3 for a GRPO run with tools."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False}):  # a "$" in a name is a dollar
        return _figure(train, evals, title)


def _figure(train: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> Any:
    """:func:`metrics_figure`'s figure, built while mathtext is off."""
    from matplotlib.figure import Figure

    kind = _run_kind(train + evals)
    if kind == "sft":
        fig = Figure(figsize=(13, 4), layout="constrained")
        loss_ax, lr_ax, ppl_ax = fig.subplots(1, 3)
        extra = [ppl_ax]
        _perplexity_panel(ppl_ax, evals)
    else:
        tools = kind == "grpo" and _called_tools(train + evals)
        fig = Figure(figsize=(13, 12 if tools else 8), layout="constrained")
        grid = fig.subplots(3 if tools else 2, 3)
        (loss_ax, lr_ax, third), (fourth, fifth, sixth) = grid[:2]
        extra = [third, fourth, fifth, sixth]
        panels = _grpo_panels if kind == "grpo" else _preference_panels
        panels(extra, train, evals)
        if tools:
            _tool_panels(grid[2], train, evals)
            extra += list(grid[2])
    fig.suptitle(f"llamatrain run: {title}", fontweight="bold")

    steps, loss = _series(train, "loss")
    loss_ax.plot(steps, loss, color="tab:blue", linewidth=1.2, label="train loss")
    steps, val = _series(evals, "val_loss")
    if val:  # a GRPO run evaluates its reward, not a loss
        loss_ax.plot(steps, val, "o-", color="tab:orange", linewidth=1.5, label="validation loss")
    loss_ax.set(title="Loss", xlabel="optimizer step", ylabel=LOSS_LABELS[kind])

    steps, lr = _series(train, "lr")
    lr_ax.plot(steps, lr, color="tab:green", label="learning rate")
    lr_ax.set(title="Learning rate", xlabel="optimizer step", ylabel="lr")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))

    for ax in (loss_ax, lr_ax, *extra):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
    return fig


def _run_kind(records: list[dict[str, Any]]) -> str:
    """Which panels a run's records call for: "grpo", "preference" or "sft"."""
    keys = {key for record in records for key in record}
    if keys.intersection(GRPO_KEYS):
        return "grpo"
    return "preference" if keys.intersection(PREFERENCE_KEYS) else "sft"


LOSS_LABELS = {
    "sft": "cross-entropy (nats/token)",
    "preference": "preference loss (per pair)",
    "grpo": "GRPO loss (near 0 by design: watch the reward)",
}
"""The loss panel's y label, by the kind of run."""


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

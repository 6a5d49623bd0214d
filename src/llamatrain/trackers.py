"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``output.loggers`` names any of :data:`TRACKERS`; each is an optional extra
(``pip install 'llamatrain[tensorboard]'``), and a missing one is a one-line ConfigError naming
it before the run starts (:func:`missing_extra`). All of them write offline, inside the run
folder, so nothing needs an account or a network:

- ``tensorboard``: event files in ``<run>/tensorboard/`` (``tensorboard --logdir <run>``);
- ``wandb``: W&B offline mode, its files in ``<run>/wandb/`` (``wandb sync`` uploads them);
- ``mlflow``: a local MLflow store, ``<run>/mlflow.db`` (SQLite: MLflow 3 refuses its
  ``mlruns/`` file store by default) with the artifacts in ``<run>/mlartifacts/``
  (``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``).

Every tracker receives the records ``metrics.jsonl`` receives (:meth:`Trackers.log`): their
numbers as scalars at their step — a training step's under ``train/`` (``train/loss``,
``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, a preference objective's
``train/reward_margin`` …), an evaluation's ``val_*`` under ``val/`` (``val/loss``,
``val/ppl``, ``val/acc``) —, a sample as text, a convergence stop as text, and the end-of-run
report (its numbers under ``report/`` and as a JSON text). The run's config is logged once as
hyperparameters (flattened to ``section.key``) and as TOML-like text.

A GRPO run's completions table (what ``completions.jsonl`` keeps: prompt, completion, each
reward function's score, the reward, the advantage; :func:`completions_table`) goes to every
tracker at each logged step, as TRL logs its own: TensorBoard's text plugin shows it as a table
(a 2-D string tensor, its first row the column names), W&B as a ``wandb.Table``, MLflow as a
JSON artifact ``completions/step-NNNNNNNN.json`` in pandas' "split" layout (``{"columns",
"data"}``, what ``MlflowClient.log_table`` writes) — written, not appended as ``log_table``
would, so the steps a resume redoes replace their tables instead of doubling them.

A resumed run continues the same tracker run where the tracker allows it: the ids are kept in
``<run>/trackers.json``; W&B resumes its run id (offline: a second offline folder, merged by
``wandb sync``), MLflow logs into the same run, TensorBoard writes a new event file in the same
folder with ``purge_step`` so the steps redone after the checkpoint replace the old ones.
Only the process that writes the run folder (rank 0) opens trackers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llamatrain.errors import CheckpointError, ConfigError, shown
from llamatrain.files import check_folder, check_target, write_text_atomically

__all__ = [
    "EXTRAS",
    "IDS_FILE",
    "TRACKERS",
    "WRITES",
    "check_writes",
    "completions_table",
    "mlflow_uri",
    "Trackers",
    "flat_config",
    "missing_extra",
    "open_trackers",
    "scalars_of",
]

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The values ``output.loggers`` may hold."""

EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker needs (the pip extra has the tracker's name)."""

IDS_FILE = "trackers.json"
"""Where a run folder keeps its tracker run ids, for a resume to continue them."""

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""The run ids a resume passes on (W&B's and MLflow's are letters, digits, ``-`` and ``_``)."""

IDS_LIMIT = 1 << 16
"""The most bytes ``trackers.json`` may hold (llamatrain writes about a hundred)."""

WRITES: dict[str, dict[str, tuple[str, ...]]] = {
    "tensorboard": {"folders": ("tensorboard",)},
    "wandb": {"folders": ("wandb",)},
    "mlflow": {"files": ("mlflow.db",), "folders": ("mlartifacts",)},
}
"""What each tracker writes in the run folder. Each is checked before the tracker opens
(:func:`check_writes`), as ``metrics.jsonl`` is: a link planted there is refused, never
followed out of the run folder."""


def missing_extra(names: Sequence[str] | None) -> str | None:
    """One line about the first of ``names`` that is unknown or not installed, else None."""
    for name in names or ():
        if name not in TRACKERS:
            return (
                f"output.loggers has {name!r}, which is not a tracker; choose any of "
                + ", ".join(repr(t) for t in TRACKERS)
            )
        if importlib.util.find_spec(EXTRAS[name]) is None:
            return (
                f"output.loggers has {name!r}, which is not installed; pip install "
                f"'llamatrain[{name}]' (or leave it out of output.loggers)"
            )
    return None


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"steps": 10}}`` → ``{"train.steps": 10}``; lists become their JSON text
    and unset values the string ``"None"`` (trackers keep numbers, strings and booleans)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flat_config(value, f"{name}.")
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value) if value is not None else "None"
    return flat


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a ``metrics.jsonl`` record under their tracker names:
    ``val_loss`` → ``val/loss``, ``loss`` → ``train/loss`` (``step`` left out)."""
    numbers = _numbers({k: v for k, v in record.items() if k != "step"}, "")
    return {
        (f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"): value
        for key, value in numbers.items()
    }


def _numbers(record: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The finite numbers (not booleans) of ``record``, their keys prefixed."""
    return {
        f"{prefix}{key}": float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def completions_table(
    records: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[list[Any]]]:
    """GRPO's completions (``completions.jsonl`` records) as a table's column names and rows:
    step, prompt, completion, each reward function's score (``rewards/<name>``, None where it
    gave none), the reward and the advantage. A prompt given as messages is its JSON text."""
    names = list(dict.fromkeys(name for r in records for name in r["rewards"]))
    columns = ["step", "prompt", "completion", *(f"rewards/{n}" for n in names)]
    columns += ["reward", "advantage"]
    rows = [
        [
            r["step"],
            r["prompt"] if isinstance(r["prompt"], str) else json.dumps(r["prompt"]),
            r["completion"],
            *(r["rewards"].get(n) for n in names),
            r["reward"],
            r["advantage"],
        ]
        for r in records
    ]
    return columns, rows


def _config_text(config: Mapping[str, Any]) -> str:
    lines = []
    for section, table in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


class _TensorBoard:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], step: int, ids: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        resumed = step > 0
        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=step + 1 if resumed else None
        )
        ids["tensorboard"] = str(run_dir / "tensorboard")
        if not resumed:  # the hyperparameters once, in the run's own folder (not add_hparams')
            for summary in hparams(flat_config(config), {"val/loss": math.nan}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", _markdown(_config_text(config)), 0)

    def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, _markdown(text), step)

    def table(self, step: int, tag: str, columns: list[str], rows: list[list[Any]]) -> None:
        cells = [columns, *([_cell(value) for value in row] for row in rows)]
        self.writer.file_writer.add_summary(_text_table(tag, cells), step)

    def report(self, step: int, report: Mapping[str, Any]) -> None:
        self.text(step, "report", json.dumps(report, indent=1))

    def close(self) -> None:
        self.writer.close()


def _markdown(text: str) -> str:
    """Text TensorBoard shows as written (its text plugin renders markdown)."""
    return "\n".join("    " + line for line in text.split("\n"))


def _cell(value: Any) -> str:
    """A table cell as text: a string as it is, anything else as JSON (None: null)."""
    return value if isinstance(value, str) else json.dumps(value)


def _text_table(tag: str, cells: list[list[str]]) -> Any:
    """A text summary holding ``cells`` as a 2-D string tensor, which TensorBoard's text plugin
    draws as a table (``add_text`` writes one string, whose markdown table would need every
    ``|`` and line break in a completion escaped)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

    plugin = SummaryMetadata.PluginData(
        plugin_name="text", content=TextPluginData(version=0).SerializeToString()
    )
    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=len(cells)),
                                  TensorShapeProto.Dim(size=len(cells[0]))])  # fmt: skip
    tensor = TensorProto(
        dtype="DT_STRING",
        string_val=[cell.encode("utf-8") for row in cells for cell in row],
        tensor_shape=shape,
    )
    value = Summary.Value(
        tag=f"{tag}/text_summary", metadata=SummaryMetadata(plugin_data=plugin), tensor=tensor
    )
    return Summary(value=[value])


class _Wandb:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], step: int, ids: dict) -> None:
        import wandb

        self.wandb = wandb
        run_id = ids.get("wandb") if step > 0 else None
        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project="llamatrain",
            name=run_dir.name,
            id=run_id,
            resume="allow" if run_id else None,
            config=flat_config(config),
            allow_val_change=True,
            settings=wandb.Settings(console="off", silent=True, save_code=False),
            reinit="create_new",
        )
        ids["wandb"] = self.run.id

    def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        table = self.wandb.Table(columns=["step", "text"], data=[[step, text]])
        self.run.log({tag: table}, step=step)

    def table(self, step: int, tag: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({tag: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def report(self, step: int, report: Mapping[str, Any]) -> None:
        self.run.summary.update({f"report/{k}": v for k, v in report.items()})

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, config: Mapping[str, Any], step: int, ids: dict) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=mlflow_uri(run_dir))
        run_id = ids.get("mlflow") if step > 0 else None
        params = flat_config(config)
        if run_id:
            logged = self._resumed(run_id, run_dir).data.params
            params = {k: v for k, v in params.items() if k not in logged}  # params never change
        else:
            experiment = self.client.get_experiment_by_name("llamatrain")
            artifacts = (run_dir / "mlartifacts").resolve().as_uri()
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment("llamatrain", artifact_location=artifacts)
            )
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            self.client.log_text(run_id, _config_text(config), "config.toml")
        self.run_id = run_id
        ids["mlflow"] = run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(run_id, params=items[start : start + 100])

    def _resumed(self, run_id: str, run_dir: Path) -> Any:
        """Run ``run_id`` of the store, running again; one missing from it (``trackers.json``
        or ``mlflow.db`` replaced) is refused in one line, not MLflow's traceback."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            raise CheckpointError(
                f"{run_dir / IDS_FILE} names MLflow run {run_id}, which {run_dir / 'mlflow.db'} "
                "does not hold; remove trackers.json to start a new tracker run"
            ) from e
        self.client.update_run(run_id, status="RUNNING")
        return run

    def scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def text(self, step: int, tag: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step-{step:08d}.txt")

    def table(self, step: int, tag: str, columns: list[str], rows: list[list[Any]]) -> None:
        table = {"columns": columns, "data": rows}  # pandas' "split" layout, as log_table's
        self.client.log_dict(self.run_id, table, f"{tag}/step-{step:08d}.json")

    def report(self, step: int, report: Mapping[str, Any]) -> None:
        self.client.log_dict(self.run_id, dict(report), "report.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_uri(run_dir: str | Path) -> str:
    """The MLflow tracking store of a run: SQLite in ``<run>/mlflow.db`` (MLflow 3 refuses its
    old ``mlruns/`` file store unless told otherwise), the artifacts in ``<run>/mlartifacts``."""
    return "sqlite:///" + str((Path(run_dir) / "mlflow.db").resolve())


_OPENERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}


def read_ids(path: Path) -> dict[str, str]:
    """The tracker run ids recorded in ``path`` for a resume to continue, refused in one line
    (CheckpointError) when damaged: a resume must not hand a tracker a value it chokes on."""
    with path.open("rb") as f:
        raw = f.read(IDS_LIMIT + 1)
    try:
        if len(raw) > IDS_LIMIT:
            raise ValueError(f"more than {IDS_LIMIT} bytes")
        ids = json.loads(raw.decode("utf-8"))
        if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
            raise ValueError("not an object of names and texts")
        for name in ("wandb", "mlflow"):
            if name in ids and not RUN_ID.fullmatch(ids[name]):
                raise ValueError(f"{name} run id {shown(ids[name])!r} is not one")
    except (ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is damaged ({shown(str(e))}); remove it to start new tracker runs "
            "(metrics.jsonl keeps every record)"
        ) from e
    return ids


def check_writes(name: str, run_dir: Path) -> None:
    """Refuse (OutputError) to open tracker ``name`` when a file or folder it writes in
    ``run_dir`` (:data:`WRITES`) is a link or not of its kind."""
    for file in WRITES[name].get("files", ()):
        check_target(run_dir / file, f"{name} store")
    for folder in WRITES[name].get("folders", ()):
        check_folder(run_dir / folder, f"{name} folder")


class Trackers:
    """The trackers of one run: each record goes to all of them (none: nothing to do)."""

    def __init__(self, trackers: Sequence[Any] = ()) -> None:
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, record: Mapping[str, Any]) -> None:
        """A ``metrics.jsonl`` record: its numbers as scalars, its sample or stop reason as
        text, its end-of-run report as the report."""
        if not self.trackers:
            return
        step = int(record.get("step", 0))
        report = record.get("report")
        for tracker in self.trackers:
            if isinstance(report, Mapping):
                tracker.scalars(step, _numbers(report, "report/"))
                tracker.report(step, report)
                continue
            scalars = scalars_of(record)
            if scalars:
                tracker.scalars(step, scalars)
            for key in ("sample", "stopped"):
                if isinstance(record.get(key), str):
                    tracker.text(step, key, record[key])

    def completions(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """GRPO's completions of step ``step`` (``completions.jsonl`` records) as the table
        ``completions`` (:func:`completions_table`)."""
        if not self.trackers or not records:
            return
        columns, rows = completions_table(records)
        for tracker in self.trackers:
            tracker.table(step, "completions", columns, rows)

    def close(self) -> None:
        """Flush and finish every tracker (each even if another fails)."""
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: PERF203 - finish the others first
                errors.append(e)
        self.trackers = []
        if errors:
            raise errors[0]

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(
    names: Sequence[str] | None, run_dir: str | Path, config: Mapping[str, Any], *, step: int
) -> Trackers:
    """Start the trackers ``names`` (``output.loggers``) for the run in ``run_dir`` whose
    config (``{section: {key: value}}``) is ``config``; ``step`` > 0 is a resume from that
    step, which continues the tracker runs recorded in ``run_dir/trackers.json``."""
    if not names:
        return Trackers()
    if problem := missing_extra(names):
        raise ConfigError(problem)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ids_path = check_target(run_dir / IDS_FILE, "tracker ids")  # read and written, never a link
    for name in names:
        check_writes(name, run_dir)
    ids = read_ids(ids_path) if ids_path.is_file() and step > 0 else {}
    opened = Trackers()
    try:
        for name in dict.fromkeys(names):
            opened.trackers.append(_OPENERS[name](run_dir, config, step, ids))
    except BaseException:
        opened.close()
        raise
    write_text_atomically(ids_path, json.dumps(ids, indent=1) + "\n", "tracker ids")
    return opened

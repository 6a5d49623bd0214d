"""Experiment trackers (``output.loggers``), for real and offline: each installed tracker logs a
short run of the tiny config, and its own files are read back with its own library —
TensorBoard's EventAccumulator, W&B's offline ``.wandb`` log, MLflow's SQLite store — to find the
scalars metrics.jsonl holds, the config, a sample and the end-of-run report. A resume continues
the same tracker run. A GRPO run's completions table reaches every tracker at each logged step,
read back from each one's files as completions.jsonl holds it. Trackers that are not installed
are skipped (each is an optional extra).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from random_models import tiny_llama
from user_errors import error_of

from llamatrain import api
from llamatrain.errors import ConfigError, OutputError
from llamatrain.plot import read_records
from llamatrain.trackers import (
    EXTRAS,
    IDS_FILE,
    TRACKERS,
    Trackers,
    completions_table,
    flat_config,
    mlflow_uri,
    open_trackers,
    scalars_of,
)

STEPS = ["train.steps=4", "train.log_every=1", "train.eval_every=2", "train.save_every=2"]
"""4 logged steps, evaluations (with samples) at steps 2 and 4, checkpoints to resume from."""


def fit(tiny_overrides, loggers: list[str], steps: int = 4, resume: str | None = None):
    overrides = tiny_overrides(**{"output.export": "false", "output.loggers": json.dumps(loggers)})
    extra = [*STEPS[1:], f"train.steps={steps}"]
    return api.fit("tiny", overrides=[*overrides, *extra], progress=False, resume=resume)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Tracker name → step → value, for every number metrics.jsonl holds."""
    out: dict[str, dict[int, float]] = {}
    for record in metrics(run_dir):
        if "report" in record:
            continue
        for name, value in scalars_of(record).items():
            out.setdefault(name, {})[record["step"]] = value
    return out


def wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file: after a 7-byte header (``:W&B``, magic, version),
    LevelDB's log format — 32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | type
    (1: full, 2: first, 3: middle, 4: last) | data`` — as wandb writes it (its Python reader
    left the package)."""
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, records, parts = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if kind == 0:
            break
        parts += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records


def test_records_become_scalars_under_train_and_val():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 9e3}
    assert scalars_of(record) == {
        "train/loss": 2.5,
        "train/lr": 1e-3,
        "train/grad_norm": 0.7,
        "train/tokens_per_s": 9e3,
    }
    val = {"step": 4, "val_loss": 2.0, "val_ppl": 7.4, "val_acc": 0.3, "sample": "text"}
    assert scalars_of(val) == {"val/loss": 2.0, "val/ppl": 7.4, "val/acc": 0.3}
    assert flat_config({"train": {"steps": 4, "x": None}, "lora": {"targets": ["wq"]}}) == {
        "train.steps": 4,
        "train.x": "None",
        "lora.targets": '["wq"]',
    }
    assert not Trackers() and open_trackers(None, "unused", {}, step=0).trackers == []


def test_an_unknown_or_missing_tracker_is_one_line(tiny_overrides, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="'neptune', which is not a tracker"):
        fit(tiny_overrides, ["neptune"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError) as caught:
        open_trackers(["wandb"], tmp_path, {}, step=0)
    assert str(caught.value) == (
        "output.loggers has 'wandb', which is not installed; pip install 'llamatrain[wandb]' "
        "(or leave it out of output.loggers)"
    )


@pytest.mark.parametrize(
    ("tracker", "planted"),
    [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow.db"),
     ("mlflow", "mlartifacts"), ("tensorboard", IDS_FILE)],
)  # fmt: skip
def test_a_link_planted_where_a_tracker_writes_is_refused_not_followed(tmp_path, tracker, planted):
    """As metrics.jsonl and .lock links are: nothing a tracker writes leaves the run folder,
    and the link is refused before the tracker opens (it writes nothing anywhere)."""
    pytest.importorskip(EXTRAS[tracker])
    run_dir, victim = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    victim.mkdir()
    if "." not in planted:  # a folder the tracker would fill; a file's link is left dangling
        (victim / planted).mkdir()
    (run_dir / planted).symlink_to(victim / planted)
    with pytest.raises(OutputError, match=f"{planted} is a symbolic link"):
        open_trackers([tracker], run_dir, {"train": {"steps": 1}}, step=1)
    assert [p.name for p in victim.rglob("*")] == ([] if "." in planted else [planted])
    assert [p.name for p in run_dir.iterdir()] == [planted]


@pytest.mark.parametrize(
    "content",
    [
        b"{",
        b"\xff\xfe",
        b"[1]",
        b'{"wandb": 3}',
        b'{"wandb": "../x"}',
        b'{"mlflow": ""}',
        b"[" * 100_000,
        b'{"a": "' + b"x" * 70_000 + b'"}',
        b'{"wandb": "\u001b[2J"}',
    ],
)
def test_a_damaged_trackers_json_is_refused_in_one_line_on_resume(tmp_path, content):
    """Cause 1 (issue 37): a resume read trackers.json with json.loads and handed whatever it
    held to the trackers — a traceback from json, a dict method or the tracker itself."""
    pytest.importorskip("tensorboard")
    (tmp_path / IDS_FILE).write_bytes(content)
    message = error_of(open_trackers, ["tensorboard"], tmp_path, {"train": {}}, step=2)
    assert "trackers.json is damaged" in message and "remove it" in message
    assert "\x1b" not in message
    assert [p.name for p in tmp_path.iterdir()] == [IDS_FILE]


def test_a_resume_naming_an_mlflow_run_the_store_lacks_is_refused_in_one_line(tmp_path):
    pytest.importorskip("mlflow")
    open_trackers(["mlflow"], tmp_path, {"train": {"steps": 1}}, step=0).close()
    (tmp_path / IDS_FILE).write_text('{"mlflow": "0123456789abcdef0123456789abcdef"}')
    message = error_of(open_trackers, ["mlflow"], tmp_path, {"train": {}}, step=2)
    assert "does not hold" in message and "remove trackers.json" in message


def test_tensorboard_event_files_hold_the_run(tiny_overrides):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = fit(tiny_overrides, ["tensorboard"])
    expected = expected_scalars(result.run_dir)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(expected)
    assert {"val/loss", "val/ppl", "val/acc"} <= set(expected)

    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name, by_step in expected.items():
        logged = {e.step: e.value for e in events.Scalars(name)}
        assert logged == pytest.approx(by_step), name
    tags = events.Tags()["tensors"]  # text summaries are tensors
    assert {"config/text_summary", "sample/text_summary", "report/text_summary"} <= set(tags)
    sample = events.Tensors("sample/text_summary")[-1]
    assert sample.step == 4
    assert result.history.samples[-1].split("\n")[0] in sample.tensor_proto.string_val[0].decode()
    report = events.Tensors("report/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert '"steps": 4' in report
    assert [e.step for e in events.Scalars("report/tokens")] == [4]


def test_tensorboard_resume_replaces_the_redone_steps(tiny_overrides):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fit(tiny_overrides, ["tensorboard"], steps=2)
    result = fit(tiny_overrides, ["tensorboard"], steps=4, resume="latest")
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]


def test_wandb_offline_run_holds_the_run_and_resumes_it(tiny_overrides):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    first = fit(tiny_overrides, ["wandb"], steps=2)
    run_id = json.loads((first.run_dir / IDS_FILE).read_text())["wandb"]
    result = fit(tiny_overrides, ["wandb"], steps=4, resume="latest")
    assert json.loads((result.run_dir / IDS_FILE).read_text())["wandb"] == run_id

    logged: dict[str, dict[int, float]] = {}
    config, summary = {}, {}
    files = sorted((result.run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the first fit's and the resumed one's, one run id
    for path in files:
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                step = json.loads(items.pop("_step"))
                for key, value in items.items():
                    if not key.startswith("_"):
                        logged.setdefault(key, {})[step] = json.loads(value)
            elif kind in ("config", "run"):  # the run record holds wandb.init's config
                updates = (record.config if kind == "config" else record.run.config).update
                config |= {i.key: json.loads(i.value_json) for i in updates}
            elif kind == "summary":
                summary |= {i.key: json.loads(i.value_json) for i in record.summary.update}
    for name, by_step in expected_scalars(result.run_dir).items():
        got = {s: v for s, v in logged.get(name, {}).items() if isinstance(v, float | int)}
        assert got == pytest.approx(by_step), name
    assert logged["sample/_type"][4] == "table-file"  # the sample, as a one-row table
    assert config["train.steps"] == 4 and config["output.loggers"] == '["wandb"]'
    assert summary["report/steps"] == 2  # the resumed fit's own report


def test_mlflow_store_holds_the_run_and_resumes_it(tiny_overrides):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    first = fit(tiny_overrides, ["mlflow"], steps=2)
    run_id = json.loads((first.run_dir / IDS_FILE).read_text())["mlflow"]
    result = fit(tiny_overrides, ["mlflow"], steps=4, resume="latest")
    assert json.loads((result.run_dir / IDS_FILE).read_text())["mlflow"] == run_id

    client = MlflowClient(tracking_uri=mlflow_uri(result.run_dir))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "2" and run.data.params["data.path"] == "sonnets"
    for name, by_step in expected_scalars(result.run_dir).items():
        history = client.get_metric_history(run_id, name)
        logged = {m.step: m.value for m in history}
        assert logged == pytest.approx(by_step), name
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    report = json.loads((artifacts / "report.json").read_text())
    assert report["steps"] == 2
    assert (artifacts / "sample" / "step-00000004.txt").read_text() == result.history.samples[-1]
    assert "[train]" in (artifacts / "config.toml").read_text()


# ---- GRPO's completions table -------------------------------------------------------------------

INSTALLED = [t for t in TRACKERS if importlib.util.find_spec(EXTRAS[t]) is not None]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    """A 2-step LoRA GRPO run (4 completions of 2 prompts a step, two built-in rewards) logging
    to every installed tracker."""
    folder = tmp_path_factory.mktemp("grpo_trackers")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf")
    prompts = folder / "prompts.jsonl"
    rows = [{"prompt": f"Say {n}.", "answer": str(n)} for n in range(8)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {
        "data.cache_dir": f'"{cache_dir}"',
        "output.dir": f'"{folder / "run"}"',
        "output.export": "false",
        "output.loggers": json.dumps(INSTALLED),
        "model.init_from": f'"{base}"',
        "data.path": f'"{prompts}"',
        "data.format": '"jsonl"',
        "data.val_fraction": "0",
        "train.objective": '"grpo"',
        "train.rewards": '["builtin:exact_answer", "builtin:length"]',
        "train.reward_args": "{length={target=4}}",
        "train.num_generations": "4",
        "train.max_completion_length": "6",
        "train.n_batch": "512",  # 8 completions a step
        "train.steps": "2",
        "train.log_every": "1",
        "train.eval_every": "0",
        "train.sample_tokens": "0",
        "lora.rank": "4",
    }
    overrides = [f"{k}={v}" for k, v in settings.items()]
    return api.fit("tiny", overrides=overrides, progress=False)


def expected_tables(run_dir: Path) -> dict[int, tuple[list[str], list[list]]]:
    """Step → the completions table of that step, from completions.jsonl."""
    records = read_records(run_dir / "completions.jsonl")
    return {s: completions_table([r for r in records if r["step"] == s]) for s in (1, 2)}


def test_the_completions_table_has_a_column_per_reward_function():
    record = {
        "step": 3,
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": "yo",
        "rewards": {"exact": None, "length": 0.5},
        "reward": 0.5,
        "advantage": -1.25,
    }
    columns, rows = completions_table([record, record | {"prompt": "2+2="}])
    assert columns == [
        "step", "prompt", "completion", "rewards/exact", "rewards/length", "reward", "advantage"
    ]  # fmt: skip
    assert rows[0] == [3, '[{"role": "user", "content": "hi"}]', "yo", None, 0.5, 0.5, -1.25]
    assert rows[1][1] == "2+2="


def test_tensorboard_holds_each_logged_steps_completions_table(grpo_run):
    if "tensorboard" not in INSTALLED:
        pytest.skip("tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(grpo_run.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    logged = {
        e.step: make_ndarray(e.tensor_proto) for e in events.Tensors("completions/text_summary")
    }
    for step, (columns, rows) in expected_tables(grpo_run.run_dir).items():
        cells = [[c.decode() for c in row] for row in logged[step].tolist()]
        assert len(rows) == 8 and cells[0] == columns  # the column names, then a row each
        want = [[c if isinstance(c, str) else json.dumps(c) for c in row] for row in rows]
        assert cells[1:] == want


def test_wandb_holds_each_logged_steps_completions_table(grpo_run):
    if "wandb" not in INSTALLED:
        pytest.skip("wandb is not installed")
    run_id = json.loads((grpo_run.run_dir / IDS_FILE).read_text())["wandb"]
    (files,) = (grpo_run.run_dir / "wandb").glob(f"offline-run-*-{run_id}/files")
    for step, (columns, rows) in expected_tables(grpo_run.run_dir).items():
        (path,) = (files / "media" / "table").glob(f"completions_{step}_*.table.json")
        table = json.loads(path.read_text())
        assert table["columns"] == columns and table["data"] == rows


def test_mlflow_holds_each_logged_steps_completions_table(grpo_run):
    if "mlflow" not in INSTALLED:
        pytest.skip("mlflow is not installed")
    import pandas as pd
    from mlflow.tracking import MlflowClient

    run_id = json.loads((grpo_run.run_dir / IDS_FILE).read_text())["mlflow"]
    run = MlflowClient(tracking_uri=mlflow_uri(grpo_run.run_dir)).get_run(run_id)
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    for step, (columns, rows) in expected_tables(grpo_run.run_dir).items():
        path = artifacts / "completions" / f"step-{step:08d}.json"
        assert json.loads(path.read_text()) == {"columns": columns, "data": rows}
        table = pd.read_json(path, orient="split")  # the layout MlflowClient.log_table writes
        assert list(table.columns) == columns and len(table) == 8

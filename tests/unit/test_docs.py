"""The README's config reference is generated from the code and must not drift from it."""

import dataclasses
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from llamatrain.config import SECTIONS, config_reference

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_reference.py"
ROW = re.compile(r"^\| `(?P<key>[a-z_]+\.[a-z_0-9]+)` \| (?P<default>.*?) \| (?P<help>.*) \|$")


def load_script():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_block() -> str:
    gen = load_script()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return readme.split(gen.START, 1)[1].split(gen.END, 1)[0]


def table_rows(block: str) -> dict[str, str]:
    """``{dotted key: default cell}`` of every key row of the generated tables."""
    rows = {}
    for line in block.splitlines():
        match = ROW.match(line)
        if match:
            assert match["key"] not in rows, f"{match['key']} is listed twice"
            rows[match["key"]] = match["default"]
    return rows


def test_readme_config_reference_is_current():
    gen = load_script()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count(gen.START) == 1 and readme.count(gen.END) == 1
    section = readme.split(gen.START, 1)[1].split(gen.END, 1)[0]
    assert section.strip() == gen.render().strip(), (
        "README.md's config reference is stale: run python scripts/gen_config_reference.py"
    )
    assert readme.index("## Config reference") < readme.index(gen.START)
    assert readme.index(gen.END) < readme.index("## Python API")


def test_readme_table_lists_exactly_the_config_keys():
    listed = table_rows(readme_block())
    keys = [key for key, _default, _help in config_reference()]
    assert keys, "config_reference() is empty"
    missing = [key for key in keys if key not in listed]
    unknown = [key for key in listed if key not in keys]
    assert not missing, f"config keys missing from README.md's table: {missing}"
    assert not unknown, f"README.md's table lists keys that are not config keys: {unknown}"
    assert list(listed) == keys, "README.md's table is not in config_reference() order"


def test_reference_leaves_out_derived_fields():
    listed = table_rows(load_script().render())
    derived = [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("derived")
    ]
    assert "model.vocab_size" in derived and "model.max_seq_len" in derived
    assert not [key for key in derived if key in listed]


def test_table_defaults_read_back_as_the_defaults():
    """Each default cell is the TOML value of the default (or *unset* for None)."""
    listed = table_rows(load_script().render())
    for key, default, _help in config_reference():
        cell = listed[key]
        if default is None:
            assert cell == "*unset*", key
            continue
        assert cell.startswith("`") and cell.endswith("`"), (key, cell)
        value = tomllib.loads("v = " + cell[1:-1].replace("\\|", "|"))["v"]
        assert value == default and type(value) is type(default), (key, cell, default)


def test_reference_renders_known_rows():
    table = load_script().render()
    assert '| `data.path` | `"shakespeare"` |' in table
    assert '| `train.sample_prompt` | `"Romeo.\\n"` |' in table
    assert "| `model.n_kv_heads` | *unset* |" in table
    assert "| `model.tie_embeddings` | `false` |" in table
    assert "| `optim.eps` | `1e-08` |" in table
    assert "('adamw' \\| 'lbfgs')" in table  # choices are listed, pipes escaped


@pytest.mark.parametrize(
    "value, text",
    [(1e-3, "0.001"), (True, "true"), ("a|b", '"a|b"'), ([1, 2], "[ 1, 2, ]"), (16384, "16384")],
)
def test_toml_value_is_one_line_of_toml(value, text):
    gen = load_script()
    assert gen.toml_value(value) == text
    assert tomllib.loads(f"v = {gen.toml_value(value)}")["v"] == value


def test_check_mode_fails_on_a_stale_readme_and_rewrite_fixes_it(tmp_path, capsys):
    gen = load_script()
    stale = tmp_path / "README.md"
    text = (REPO / "README.md").read_text(encoding="utf-8")
    stale.write_text(text.replace("| `optim.lr` |", "| `optim.learning_rate` |"))
    assert gen.main(["--check", "--readme", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main(["--readme", str(stale)]) == 0
    assert stale.read_text() == text
    assert gen.main(["--check", "--readme", str(stale)]) == 0

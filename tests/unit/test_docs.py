"""The docs' generated references (config keys, CLI arguments) come from the code and must not
drift from it: each page's block is compared against a fresh rendering."""

import dataclasses
import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

from llamatrain.cli import build_parser
from llamatrain.config import SECTIONS, config_reference

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))  # the generators import their shared generated_block

gen_config = importlib.import_module("gen_config_reference")
gen_cli = importlib.import_module("gen_cli_reference")
generated_block = importlib.import_module("generated_block")

ROW = re.compile(r"^\| `(?P<key>[a-z_]+\.[a-z_0-9]+)` \| (?P<default>.*?) \| (?P<help>.*) \|$")


def page_block(gen) -> str:
    return generated_block.block(gen.PAGE.read_text(encoding="utf-8"), gen.NAME)


def table_rows(block: str) -> dict[str, str]:
    """``{dotted key: default cell}`` of every key row of the generated tables."""
    rows = {}
    for line in block.splitlines():
        match = ROW.match(line)
        if match:
            assert match["key"] not in rows, f"{match['key']} is listed twice"
            rows[match["key"]] = match["default"]
    return rows


@pytest.mark.parametrize("gen", [gen_config, gen_cli], ids=["config", "cli"])
def test_generated_reference_is_current(gen):
    assert page_block(gen).strip() == gen.render().strip(), (
        f"{gen.PAGE.relative_to(REPO)} is stale: run python scripts/{Path(gen.__file__).name}"
    )


def test_config_table_lists_exactly_the_config_keys():
    listed = table_rows(page_block(gen_config))
    keys = [key for key, _default, _help in config_reference()]
    assert keys, "config_reference() is empty"
    missing = [key for key in keys if key not in listed]
    unknown = [key for key in listed if key not in keys]
    assert not missing, f"config keys missing from the config reference: {missing}"
    assert not unknown, f"the config reference lists keys that are not config keys: {unknown}"
    assert list(listed) == keys, "the config reference is not in config_reference() order"


def test_reference_leaves_out_derived_fields():
    listed = table_rows(gen_config.render())
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
    listed = table_rows(gen_config.render())
    for key, default, _help in config_reference():
        cell = listed[key]
        if default is None:
            assert cell == "*unset*", key
            continue
        assert cell.startswith("`") and cell.endswith("`"), (key, cell)
        value = tomllib.loads("v = " + cell[1:-1].replace("\\|", "|"))["v"]
        assert value == default and type(value) is type(default), (key, cell, default)


def test_reference_renders_known_rows():
    table = gen_config.render()
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
    assert gen_config.toml_value(value) == text
    assert tomllib.loads(f"v = {gen_config.toml_value(value)}")["v"] == value


def test_cli_reference_lists_every_argument_of_every_command():
    """Each subcommand has its section, and each of its flags and positionals a row."""
    block = page_block(gen_cli)
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        section = block.split(f"## `llamatrain {name}`", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            shown = action.option_strings[-1] if action.option_strings else action.dest
            assert f"`{shown}" in section or f", {shown}" in section, (name, shown)
    assert "| `--resume PATH|latest` |  | continue from a checkpoint" in block
    assert "| `--type TYPE` | `auto` |" in block
    assert "| `--data DATA` | required | text file to score |" in block


@pytest.mark.parametrize("gen", [gen_config, gen_cli], ids=["config", "cli"])
def test_check_mode_fails_on_a_stale_page_and_rewrite_fixes_it(gen, tmp_path, capsys):
    stale = tmp_path / "page.md"
    text = gen.PAGE.read_text(encoding="utf-8")
    first_row = next(line for line in page_block(gen).splitlines() if line.startswith("| `"))
    stale.write_text(text.replace(first_row, "| `stale` | | |"), encoding="utf-8")
    argv = ["--page", str(stale)]
    assert generated_block.main(gen.NAME, gen.render, gen.PAGE, ["--check", *argv]) == 1
    assert f"run python scripts/gen_{gen.NAME.replace('-', '_')}.py" in capsys.readouterr().err
    assert generated_block.main(gen.NAME, gen.render, gen.PAGE, argv) == 0
    assert stale.read_text(encoding="utf-8") == text
    assert generated_block.main(gen.NAME, gen.render, gen.PAGE, ["--check", *argv]) == 0

"""The README's config reference is generated from the code and must not drift from it."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_reference.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_config_reference_is_current():
    gen = load_script()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split(gen.START, 1)[1].split(gen.END, 1)[0]
    assert section.strip() == gen.render().strip(), (
        "README.md's config reference is stale: run python scripts/gen_config_reference.py"
    )
    assert readme.index("## Config reference") < readme.index(gen.START)
    assert readme.index(gen.END) < readme.index("## Python API")


def test_reference_lists_every_key_with_its_default():
    from llamatrain.config import config_reference

    gen = load_script()
    table = gen.render()
    for key, _default, _help in config_reference():
        assert f"| `{key}` |" in table
    assert '| `data.path` | `"shakespeare"` |' in table
    assert "| `model.n_kv_heads` | *unset* |" in table
    assert "('adamw' \\| 'lbfgs')" in table  # choices are listed, pipes escaped


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

"""The example notebooks run, end to end, in their short version (``LLAMATRAIN_QUICK=1``),
from a temporary working directory: they need only the installed package, not the repository.

Each notebook prints one ``SUMMARY {json}`` line in its last cell; the assertions read that,
so a notebook that "runs" but no longer trains, exports or generates fails here. The committed
notebooks must carry no outputs (they would go stale, bloat diffs and hide what a fresh run
prints). A notebook writes only under ``runs/<its name>/``, and a second Run All in the same
folder works as the first did (issue 38: lora_chat's second run stopped on its own last run):
the slow test runs each one twice there.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbclient  # the [test] extra: a missing one fails these tests rather than skipping
import nbformat
import pytest
from notebook_checks import (
    CHECKS,
    check_baby_llama,
    check_grpo,
    check_grpo_tools,
    check_lora_chat,
    check_quickstart,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_the_examples_exist():
    assert {p.name for p in NOTEBOOKS} >= {
        "quickstart.ipynb",
        "baby_llama.ipynb",
        "lora_chat.ipynb",
        "grpo.ipynb",
        "grpo_tools.ipynb",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs; clear them"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert book.metadata.kernelspec.name == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_reads_the_quick_switch(path):
    book = nbformat.read(path, as_version=4)
    first = next(c for c in book.cells if c.cell_type == "code")
    assert 'QUICK = os.environ.get("LLAMATRAIN_QUICK", "0") == "1"' in first.source


def execute(name: str, monkeypatch, workdir: Path) -> dict:
    """Run examples/NAME in a fresh python3 kernel (quick mode) whose working directory is
    ``workdir``, outside the repository as after ``pip install``; return its SUMMARY."""
    monkeypatch.setenv("LLAMATRAIN_QUICK", "1")  # the kernel inherits this environment
    book = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(
        book,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    last = [c for c in book.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in last.outputs if o.output_type == "stream")
    lines = [line for line in text.splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"{name}: the last cell printed no SUMMARY line:\n{text}"
    written = sorted(str(p.relative_to(workdir)) for p in workdir.iterdir())
    assert written in ([], ["runs"]), f"{name} wrote outside runs/: {written}"
    if written:
        mine = Path(name).stem
        folders = [p.name for p in (workdir / "runs").iterdir()]
        assert folders == [mine], f"{name} wrote outside runs/{mine}: {folders}"
    return json.loads(lines[-1].removeprefix("SUMMARY "))


def test_every_notebook_has_its_checks():
    assert {p.name for p in NOTEBOOKS} == set(CHECKS)


# Slow, all of them: the default suite's docs build (tests/unit/test_docs_site.py) executes
# every notebook once and applies these same checks to the SUMMARY lines it renders; here each
# also runs from a folder outside the repository and must write only under runs/<its name>/.
@pytest.mark.slow
def test_quickstart_trains_exports_and_runs_in_llama_cpp(monkeypatch, tmp_path):
    check_quickstart(execute("quickstart.ipynb", monkeypatch, tmp_path))


@pytest.mark.slow
def test_baby_llama_learns_and_both_optimizers_solve_the_matrix_check(monkeypatch, tmp_path):
    check_baby_llama(execute("baby_llama.ipynb", monkeypatch, tmp_path))


@pytest.mark.slow
def test_lora_chat_trains_adapters_and_llama_cpp_replies_as_pytorch(monkeypatch, tmp_path):
    check_lora_chat(execute("lora_chat.ipynb", monkeypatch, tmp_path))


@pytest.mark.slow
def test_grpo_from_a_prompt_file_and_a_reward_function_to_llama_cpp(monkeypatch, tmp_path):
    """GRPO from a JSONL prompt file and a reward defined in the notebook to the adapter in
    llama.cpp (~30 s on 2 shared cores: a stand-in base, 20 GRPO steps, two engines)."""
    check_grpo(execute("grpo.ipynb", monkeypatch, tmp_path))


@pytest.mark.slow
def test_grpo_tools_from_a_python_tool_to_an_adapter_llama_cpp_serves(monkeypatch, tmp_path):
    """Tool-using GRPO with a tool and a reward defined in the notebook (``tools=``) to the
    adapter in llama.cpp, replying to the prompt rendered with the tool as our decoder does."""
    check_grpo_tools(execute("grpo_tools.ipynb", monkeypatch, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_second_run_all_in_the_same_folder_works(path, monkeypatch, tmp_path):
    """Run All twice in one folder, as a user does: the second run checks out as the first,
    and what the first wrote was moved aside (``overwrite=True``), not trained on again
    (a run folder holding a run is otherwise refused). A notebook that writes nothing finds
    the folder as it found it the first time."""
    first = execute(path.name, monkeypatch, tmp_path)
    runs = tmp_path / "runs" / path.stem
    before = sorted(p.name for p in runs.iterdir()) if runs.exists() else []
    second = execute(path.name, monkeypatch, tmp_path)
    CHECKS[path.name](second)
    if not before:
        assert not runs.exists() and second == first  # nothing written: the same run again
        return
    after = sorted(p.name for p in runs.iterdir())
    aside = [name for name in after if name not in before]
    assert aside and all(".old-1" in name for name in aside), after
    for name in aside:  # the first run's folder, as it was: a run moved aside, not deleted
        assert (runs / name / "config.toml").is_file(), name

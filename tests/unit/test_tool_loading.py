"""``train.tools`` specs load as ``train.rewards`` specs do (one shared import), each tool with
the schema transformers would make for it."""

from __future__ import annotations

import sys

import pytest
from transformers.utils import get_json_schema

from llamatrain.errors import ConfigError
from llamatrain.objectives.grpo import rewards
from llamatrain.tools.loading import check, load

TOOLS_FILE = '''
print("ran")


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: Digits and + - * /.
    """
    return expression


async def search(query: str, limit: int = 3) -> list[str]:
    """Search.

    Args:
        query: What to look for.
        limit: How many results.
    """
    return []


class Shelf:
    @staticmethod
    def fetch(title: str) -> str:
        """Fetch a book.

        Args:
            title: Its title.
        """
        return title


class AsyncCallable:
    async def __call__(self, x: int) -> int:
        return x


VALUE = 3
'''


@pytest.fixture
def in_tmp(code_dir):
    """A working directory holding tool files (conftest's ``code_dir``)."""
    (code_dir / "my_tools.py").write_text(TOOLS_FILE)
    return code_dir


def test_tools_load_from_a_file_once_with_transformers_schemas(in_tmp, capsys):
    tools = load(
        ["my_tools.py:calculator", f"{in_tmp}/my_tools.py:search", "my_tools.py:Shelf.fetch"]
    )
    assert capsys.readouterr().out == "ran\n"
    assert [(t.name, t.is_async) for t in tools] == [
        ("calculator", False),
        ("search", True),
        ("fetch", False),
    ]
    for tool in tools:
        assert tool.schema == get_json_schema(tool.fn)
    assert tools[0].fn("1+2") == "1+2"


def test_a_reward_and_a_tool_in_one_file_run_it_once(in_tmp, capsys):
    (in_tmp / "my_tools.py").write_text(
        TOOLS_FILE + "\ndef score(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    load(["my_tools.py:calculator"])
    rewards.load(["my_tools.py:score"])
    assert capsys.readouterr().out == "ran\n"


def test_functions_and_methods_load_as_callables_too():
    module = {}
    exec(compile(TOOLS_FILE.replace('print("ran")', ""), "tools", "exec"), module)
    obj = module["AsyncCallable"]()
    obj.__call__.__func__.__doc__ = "Identity.\n\nArgs:\n    x: A number.\n"
    calculator, method = load([module["calculator"], obj.__call__])
    assert (calculator.name, calculator.is_async) == ("calculator", False)
    assert calculator.spec.endswith(":calculator")
    assert (method.name, method.is_async) == ("__call__", True)
    assert method.schema == get_json_schema(obj.__call__)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["no_colon"], r"train\.tools: 'no_colon' is not one of 'package\.module:function'"),
        (["pkg-x:f"], r"names neither a module .* nor a \.py file"),
        (["a:f", "b.py:f"], r"two tools called 'f'; the model calls a tool by its name"),
        (["llamatrain_no_such_pkg:f"], r"no module named .*train\.tools runs the module it names"),
        (["missing.py:f"], r"tool 'missing\.py:f': no file .*missing\.py"),
        (["broken.py:f"], r"running broken\.py raised NameError"),
        (["my_tools.py:nope"], r"my_tools\.py has no attribute 'nope'"),
        (["my_tools.py:VALUE"], r"VALUE is a int, not a function; name a function whose type"),
        (["my_tools.py:AsyncCallable"], r"AsyncCallable is a type, not a function or method"),
        ([3], r"tool 3 is a int, not a function or method"),
    ],
)
def test_a_bad_tool_fails_in_one_line_naming_it(specs, message, in_tmp):
    with pytest.raises(ConfigError, match=message) as caught:
        load(specs)
    assert "\n" not in str(caught.value)


def test_check_imports_nothing():
    check(["llamatrain_no_such_pkg.mod:f", "other.py:g"])
    assert "llamatrain_no_such_pkg" not in sys.modules


def test_a_decorator_renaming_two_tools_alike_is_caught(in_tmp):
    (in_tmp / "renamed.py").write_text(TOOLS_FILE + "\nfirst = calculator\nsecond = calculator\n")
    with pytest.raises(ConfigError, match="two tools called 'calculator'"):
        load(["renamed.py:first", "renamed.py:second"])

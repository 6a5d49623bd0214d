"""``train.tools`` and its settings: refused in one line where they cannot work, and a tool that
misbehaves (exits, changes directory, exits while its module loads) cannot end or move the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llama_cpp_files import vocab_dir as vocab_dir
from test_grpo_setup import GRPO
from test_grpo_setup import checked as check_config
from tool_functions import lookup, multiply

from llamatrain.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from llamatrain.data.prompts import PromptEncoder
from llamatrain.errors import ConfigError, DataError, LlamatrainWarning
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.objectives.grpo.rules import check_given_tools, check_tool_template
from llamatrain.tools.loading import load
from llamatrain.tools.running import RAISED, run_call

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"


def checked(overrides):
    return check_config("tiny", overrides)


def test_tools_need_grpo_and_well_formed_specs():
    with pytest.raises(ConfigError, match="train.tools .* samples none: set train.objective"):
        checked(['train.tools=["tools.py:add"]'])
    with pytest.raises(ConfigError, match="train.tools"):
        checked([*GRPO, 'train.tools=["no_function_named"]'])
    with pytest.raises(ConfigError, match="two tools called 'add'"):
        checked([*GRPO, 'train.tools=["a.py:add", "b.py:add"]'])
    cfg = checked([*GRPO, 'train.tools=["tools.py:add"]', "train.max_tool_calls=2"])
    assert cfg.train.max_tool_calls == 2 and cfg.train.tool_timeout == 10.0
    with pytest.raises(ConfigError, match="tool_timeout"):
        checked([*GRPO, 'train.tools=["tools.py:add"]', "train.tool_timeout=0"])


def test_tools_given_in_python_stand_in_for_train_tools_in_grpo_only():
    """``fit(cfg, tools=[...])``'s check: callables (or specs) in place of train.tools."""
    check_given_tools(checked(GRPO), [multiply, lookup])
    check_given_tools(checked(GRPO), None)
    check_given_tools(checked(["train.steps=1"]), None)  # nothing given: nothing to check
    with pytest.raises(ConfigError, match="tools= answer turns .* samples none"):
        check_given_tools(checked(["train.steps=1"]), [multiply])
    with pytest.raises(ConfigError, match="tools= in Python and train.tools .* give one"):
        check_given_tools(checked([*GRPO, 'train.tools=["t.py:f"]']), [multiply])
    env = checked([*GRPO, 'train.environment="env.py:make_env"'])
    with pytest.raises(ConfigError, match="tools= in Python and train.environment"):
        check_given_tools(env, [multiply])
    with pytest.raises(ConfigError, match="two tools called 'multiply'"):
        check_given_tools(checked(GRPO), [multiply, multiply])


def test_a_template_must_render_the_tools_and_a_generic_one_is_said():
    with pytest.raises(ConfigError, match="renders tools into the prompt, and no chat template"):
        check_tool_template(None)
    with pytest.raises(ConfigError, match="the chat template chatml does not"):
        check_tool_template(ChatTemplate(BUILTIN_TEMPLATES["chatml"], name="chatml"))
    generic = ChatTemplate(
        "{% if tools %}Tools: {{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        name="plain",
    )
    with pytest.warns(LlamatrainWarning, match="generic JSON form"):
        check_tool_template(generic)
    qwen = ChatTemplate((TEMPLATES / "qwen2.5.jinja").read_text(), name="qwen2.5")
    check_tool_template(qwen)  # Hermes calls, nothing to say


def test_prompts_with_tools_are_messages_rendered_with_the_tools(vocab_dir: Path):
    template = ChatTemplate((TEMPLATES / "qwen2.5.jinja").read_text(), name="qwen2.5")
    schema = load([add])[0].schema
    encoder = PromptEncoder(read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf"), template, [schema])
    with pytest.raises(DataError, match="with train.tools a prompt is a list of messages"):
        encoder.encode("What is 1 + 2?")
    messages = [{"role": "user", "content": "1+2"}]
    ids = encoder.encode(messages)
    rendered = template.render(messages, add_generation_prompt=True, tools=[schema])
    assert '"name": "add"' in rendered and ids == encoder.tokenizer.encode(rendered, special=True)


def test_smollm3s_template_is_shown_the_tools_as_its_xml_tools(vocab_dir: Path):
    """SmolLM3's template renders no ``tools``, only its ``xml_tools`` (its model card passes
    the schemas there): the prompt lists the tool and asks for Hermes calls."""
    source = (TEMPLATES / "smollm3.jinja").read_text()
    template = ChatTemplate(source, name="smollm3")
    schema = load([add])[0].schema
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    messages = [{"role": "user", "content": "1+2"}]
    assert "add" not in template.render(messages, add_generation_prompt=True, tools=[schema])
    rendered = template.render(messages, add_generation_prompt=True, xml_tools=[schema])
    assert "'name': 'add'" in rendered and "<tool_call>" in rendered
    ids = PromptEncoder(tokenizer, template, [schema]).encode(messages)
    assert ids == tokenizer.encode(rendered, special=True)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def leaves(to: str) -> str:
    """Changes directory, then exits.

    Args:
        to: Where to.
    """
    os.chdir(to)
    raise SystemExit(0)


def test_a_tool_that_exits_or_moves_cannot_end_or_move_the_run(tmp_path: Path):
    here = os.getcwd()
    outcome = run_call(load([leaves])[0], {"to": str(tmp_path)}, timeout=5.0, max_chars=100)
    assert os.getcwd() == here
    assert outcome.failure == RAISED and outcome.content == "{'error': '0'}"


def test_a_tool_module_that_exits_while_loading_is_a_config_error(tmp_path: Path):
    module = tmp_path / "exits.py"
    module.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ConfigError, match="SystemExit"):
        load([f"{module}:anything"])

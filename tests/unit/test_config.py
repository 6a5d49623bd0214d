"""Config loading, overrides, validation messages, round trips and the shipped configs."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from user_errors import error_of

from llamatrain.config import (
    SECTIONS,
    Config,
    apply_overrides,
    apply_values,
    builtin_config_names,
    config_from_dict,
    config_reference,
    config_to_dict,
    config_to_toml,
    load_config,
    validate,
)
from llamatrain.errors import ConfigError
from llamatrain.objectives import check
from llamatrain.settings import is_config_key

SHIPPED = builtin_config_names()


def write(tmp_path: Path, text: str, name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- loading ---------------------------------------------------------------------------------


def test_defaults_are_valid_and_fill_n_ubatch():
    cfg = load_config(None)
    assert cfg.model.dim == 256 and cfg.optim.name == "adamw"
    assert cfg.train.n_ubatch == cfg.train.n_batch  # derived default filled by validate


def test_file_values_and_int_accepted_for_float(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 1\n[model]\nn_kv_heads = 4\n[data]\npath = ['a', 'b']\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.model.n_kv_heads == 4
    assert cfg.data.path == ["a", "b"]
    assert cfg.origin("optim.lr") == str(path)
    assert cfg.origin("optim.eps") == "the defaults"


@pytest.mark.parametrize("name", SHIPPED)
def test_built_in_configs_load_by_name_from_any_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of the repository is here
    cfg = load_config(name)
    assert cfg == load_config(f"{name}.toml")
    assert cfg.train.n_batch % cfg.data.n_ctx == 0
    assert cfg.data.path in ("shakespeare", "sonnets")  # built-in corpora, found anywhere


def test_expected_configs_are_shipped():
    assert set(SHIPPED) >= {"tiny", "shakespeare", "ggml-2023"}


def test_a_file_wins_over_a_built_in_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[train]\nsteps = 7\n", "tiny")
    assert load_config("tiny").train.steps == 7


def test_ggml_2023_matches_the_2023_defaults():
    cfg = load_config("ggml-2023")
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (cfg.data.n_ctx, m.dim, m.n_heads, m.n_layers, m.ffn_dim) == (128, 256, 8, 16, 768)
    assert (m.norm_eps, m.rope_theta, t.n_batch // cfg.data.n_ctx) == (1e-5, 10000.0, 8)
    assert (o.lr, o.lr_min, o.weight_decay, o.beta1, o.beta2, o.grad_clip) == (
        1e-3, 1e-4, 0.1, 0.9, 0.999, 1.0,
    )  # fmt: skip
    assert (o.warmup_steps, o.cos_decay_steps, t.checkpointing) == (100, 1000, "auto")


# ---- error kinds -------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    msg = error_of(load_config, tmp_path / "nope.toml")
    assert "nope.toml" in msg and "not found" in msg
    assert "built-in configs: ggml-2023, shakespeare, tiny" in msg


def test_derived_model_fields_are_not_config_keys(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[model]\nvocab_size = 100\n"))
    assert "model.vocab_size" in msg and "not a config key" in msg and "tokenizer" in msg
    msg = error_of(load_config, None, ["model.max_seq_len=64"])
    assert "not a config key" in msg and "data.n_ctx" in msg


def test_bad_toml_syntax(tmp_path):
    path = write(tmp_path, "[model]\ndim = \n")
    msg = error_of(load_config, path)
    assert str(path) in msg and "not valid TOML" in msg and "line 2" in msg


def test_unknown_section_suggests(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[optimizer]\nlr = 1e-3\n"))
    assert "unknown section [optimizer]" in msg and "did you mean [optim]" in msg


def test_top_level_key_points_to_its_section(tmp_path):
    msg = error_of(load_config, write(tmp_path, "steps = 10\n"))
    assert "[train]" in msg


def test_unknown_key_suggests_closest(tmp_path):
    path = write(tmp_path, "[optim]\nwarmup_step = 10\n")
    msg = error_of(load_config, path)
    assert "optim.warmup_step" in msg and str(path) in msg
    assert "did you mean optim.warmup_steps" in msg


def test_key_in_wrong_section_names_the_right_one(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[model]\nn_ctx = 64\n"))
    assert "belongs in [data]" in msg and "data.n_ctx" in msg


def test_wrong_type_message(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 'abc'\n")
    assert error_of(load_config, path) == f"optim.lr in {path} must be a number, got 'abc'"


@pytest.mark.parametrize(
    "text, key, expected",
    [
        ("[model]\ndim = true", "model.dim", "an integer"),  # bools are not ints
        ("[model]\ndim = 1.5", "model.dim", "an integer"),
        ("[train]\ncompile = 1", "train.compile", "true or false"),
        ("[data]\npath = [1]", "data.path", "a string or a list of strings"),
        ("[model]\nn_kv_heads = 'x'", "model.n_kv_heads", "left out"),
        ("[model]\ndim = {a = 1}", "model.dim", "an integer"),
        ("model = 3", "model", "section"),
    ],
)
def test_type_errors(tmp_path, text, key, expected):
    msg = error_of(load_config, write(tmp_path, text + "\n"))
    assert msg.startswith(key) and expected in msg


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["optim.lr=0"], ["optim.lr", "> 0"]),
        (["optim.lr=-1e-3"], ["optim.lr", "> 0"]),
        (["train.n_batch=1000"], ["train.n_batch = 1000", "multiple of data.n_ctx = 128", "896"]),
        (["train.n_ubatch=384"], ["train.n_ubatch = 384", "divide", "[128, 256, 512, 1024]"]),
        (["train.n_ubatch=100"], ["train.n_ubatch = 100", "multiple of data.n_ctx"]),
        (["model.dim=100"], ["model.dim = 100", "divisible by model.n_heads = 8"]),
        (["model.n_kv_heads=3"], ["model.n_kv_heads = 3", "divide", "[1, 2, 4, 8]"]),
        (["model.dim=24", "model.n_heads=8"], ["head_dim", "= 3", "even"]),
        (["data.val_fraction=0.5"], ["data.val_fraction", "< 0.5"]),
        (["data.val_fraction=-0.1"], ["data.val_fraction", ">= 0"]),
        (["optim.name=sgd"], ["optim.name", "'adamw', 'lbfgs'", "'sgd'"]),
        (["data.sample_start=random"], ["data.sample_start", "'newline'"]),
        (["output.export_type=q5_k"], ["output.export_type", "'q4_0'"]),
        (["optim.lr_min=0.1"], ["optim.lr_min = 0.1", "must not exceed optim.lr"]),
        (["optim.cos_decay_restart=0.5"], ["cos_decay_restart", "0 (no restarts) or >= 1"]),
        (["optim.beta2=1.0"], ["optim.beta2", "< 1"]),
        (["model.dim=48", "model.n_heads=4", "output.export_type=q8_0"], ["multiples of 32"]),
        (["lora.rank=8"], ["lora.rank = 8", "model.init_from is unset"]),
        (["lora.rank=-1"], ["lora.rank", ">= 0"]),
        (["lora.alpha=0"], ["lora.alpha", "> 0"]),
        (["lora.dropout=1"], ["lora.dropout", "< 1"]),
        (["lora.targets=['attn_q', 'wq']"], ["lora.targets", "'wq'", "attn_output, ffn_gate"]),
        (["lora.targets=['ffn_up', 'ffn_up']"], ["lora.targets", "each projection once"]),
        (["lora.targets=[]"], ["lora.targets", "at least one"]),
        (["lora.decode=fast"], ["lora.decode", "'compiled'", "'fast'"]),
        (
            [
                "lora.rank=8",
                "model.init_from=base.gguf",
                "lora.base_dtype=quantized",
                "train.compile=true",
            ],
            ["train.compile = true", "lora.base_dtype = 'quantized'", "set train.compile = false"],
        ),
    ],
)
def test_impossible_values(overrides, fragments):
    msg = error_of(load_config, None, overrides)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert "--set" in msg  # says where the bad value came from


@pytest.mark.parametrize("value", ["inf", "-inf", "1e999"])
@pytest.mark.parametrize(
    "key",
    ["model.norm_eps", "model.rope_theta", "model.rope_scaling_factor", "model.rope_theta_swa",
     "model.final_logit_softcap", "optim.lr", "train.dist_timeout_s", "train.sample_temperature",
     "lora.alpha"],
)  # fmt: skip
def test_no_setting_takes_an_infinity(key, value):
    """Issue 37, items 1 and 5: an infinity passed every '> 0' bound (a gemma3 soft-cap of inf
    ended in a traceback, a rope base of inf trained on NaN); the one rule of every field."""
    arch = ["model.arch=gemma3"] if "swa" in key or "softcap" in key else []
    msg = error_of(load_config, None, [*arch, f"{key}={value}"])
    assert key in msg and "must be a finite number" in msg and "--set" in msg


@pytest.mark.parametrize(
    ("item", "fragment"),
    [("train.sample_temperature=2e6", "[0, 1e6]"), ("train.seed=-1", ">= 0"),
     ("train.seed=4294967296", "<= 4294967295")],
)  # fmt: skip
def test_values_the_run_meets_late_are_refused_before_it_starts(item, fragment):
    """Issue 37, item 1: a sample temperature of 2e6 trained until the first sample refused it;
    a seed of -1 until sentencepiece's generator (uint32) raised TypeError."""
    msg = error_of(load_config, None, [item])
    assert item.split("=")[0] in msg and fragment in msg and "--set" in msg


def test_grpos_rollout_sampler_is_checked_before_the_first_step():
    """The rollouts' temperature (> 0 by its field) met SamplingParams' range at the first
    rollout; every sampler a run builds is built by validation first."""
    grpo = ['train.objective="grpo"', 'data.format="jsonl"', 'train.rewards=["builtin:format"]',
            "train.num_generations=2", "train.max_completion_length=16",
            "train.temperature=2e6"]  # fmt: skip
    msg = error_of(lambda: check(load_config("tiny", grpo)))
    assert "train.temperature" in msg and "[0, 1e6]" in msg


def test_validation_names_the_file(tmp_path):
    path = write(tmp_path, "[train]\nn_batch = 1000\n")
    msg = error_of(load_config, path)
    assert str(path) in msg


def test_lora_is_off_by_default_and_adapts_every_projection_when_on():
    assert load_config(None).lora.rank == 0  # full finetuning
    cfg = load_config(None, ["model.init_from=base.gguf", "lora.rank=8", "lora.alpha=32"])
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout) == (8, 32.0, 0.0)
    assert cfg.lora.targets is None  # all seven projections (api.fit applies ALL_TARGETS)
    cfg = load_config(None, ["model.init_from=b.gguf", "lora.rank=4", "lora.targets=['attn_v']"])
    assert cfg.lora.targets == ["attn_v"]


def test_init_from_skips_architecture_checks():
    cfg = load_config(None, ["model.init_from=base.gguf", "model.dim=100"])
    assert cfg.model.init_from == "base.gguf"


# ---- overrides -------------------------------------------------------------------------------


def test_override_value_parsing():
    cfg = apply_overrides(
        Config(),
        [
            "optim.lr=3e-4",
            "model.n_layers=4",
            "data.path=a.txt",  # bare string
            "train.sample_prompt=1984",  # a number-looking string stays a string
            "train.compile=true",
            "model.rope_theta=500000",  # int for a float field
            "data.path=['x.txt', 'y.txt']",
            "tokenizer.path='tok.model'",
            "model.n_kv_heads=2",
            "model.n_kv_heads=none",  # unset again
            "output.dir = runs/a b",  # spaces around '=' and inside the value
        ],
    )
    assert cfg.optim.lr == 3e-4 and cfg.model.n_layers == 4
    assert cfg.train.sample_prompt == "1984" and cfg.train.compile is True
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.data.path == ["x.txt", "y.txt"] and cfg.tokenizer.path == "tok.model"
    assert cfg.model.n_kv_heads is None and cfg.output.dir == "runs/a b"
    assert cfg.origin("optim.lr") == "--set optim.lr=3e-4"


def test_python_values_are_checked_like_overrides():
    cfg = apply_values(Config(), {"train.steps": 20, "data.path": ["a", "b"]}, "fit(...)")
    assert cfg.train.steps == 20 and cfg.origin("train.steps") == "fit(...) train.steps"
    msg = error_of(apply_values, Config(), {"train.steps": "20"}, "fit(...)")
    assert msg == "train.steps in fit(...) train.steps must be an integer, got '20'"
    assert "did you mean optim.lr" in error_of(apply_values, Config(), {"optim.lrr": 1}, "x")


def test_override_fixes_file_before_validation(tmp_path):
    path = write(tmp_path, "[optim]\nlr = -1.0\n")
    assert load_config(path, ["optim.lr=0.01"]).optim.lr == 0.01


@pytest.mark.parametrize(
    "item, fragments",
    [
        ("optim.lr=abc", ["optim.lr in --set optim.lr=abc must be a number, got 'abc'"]),
        ("model.dim=true", ["model.dim", "an integer", "true"]),
        ("optim.lrr=1", ["unknown key optim.lrr", "did you mean optim.lr"]),
        ("optimizer.lr=1", ["unknown section [optimizer]", "[optim]"]),
        ("lr=1", ["needs its section", "optim.lr"]),
        ("optim.lr", ["section.key=value"]),
        ("model.dim=none", ["model.dim", "an integer"]),  # dim cannot be unset
    ],
)
def test_override_errors(item, fragments):
    msg = error_of(apply_overrides, Config(), [item])
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


# ---- round trips and reference ----------------------------------------------------------------


def test_dict_round_trip():
    cfg = load_config(None, ["model.n_kv_heads=2", "data.path=['a', 'b']", "optim.lr=5e-4"])
    again = config_from_dict(config_to_dict(cfg))
    assert again == cfg
    assert config_to_dict(cfg)["model"]["n_kv_heads"] == 2


@pytest.mark.parametrize("name", [None, *SHIPPED])
def test_toml_round_trip(tmp_path, name):
    cfg = load_config(name, ['train.sample_prompt="He said \\"hi\\"\\n\\tüñ"'])
    out = write(tmp_path, config_to_toml(cfg), "dump.toml")
    assert load_config(out) == cfg


def test_config_reference_covers_every_field():
    rows = config_reference()
    keys = [k for k, _, _ in rows]
    expected = [
        f"{s}.{f.name}"
        for s, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if is_config_key(f)
    ]
    assert keys == expected and "model.attention" in keys
    assert "model.vocab_size" not in keys and "model.max_seq_len" not in keys
    assert all(help_text.strip() for _, _, help_text in rows)
    table = {k: (d, h) for k, d, h in rows}
    assert table["optim.lr"][0] == 1e-3
    assert "'adamw'" in table["optim.name"][1]


def test_validate_returns_config_and_is_idempotent():
    cfg = Config()
    assert validate(validate(cfg)) is cfg


def test_derived_n_ubatch_follows_a_later_n_batch_override():
    cfg = load_config(None)
    validate(apply_overrides(cfg, ["train.n_batch=2048"]))
    assert cfg.train.n_ubatch == 2048
    validate(apply_overrides(cfg, ["train.n_ubatch=512", "train.n_batch=1024"]))
    assert cfg.train.n_ubatch == 512  # an explicit value stays


def test_a_quantizer_export_type_needs_its_extra_before_the_run(monkeypatch):
    # A K-quant export is written by llama.cpp's quantizer (the `quantize` extra): without it,
    # the config is refused when it is read, not after the training it would end.
    cfg = load_config("tiny", ["output.export_type=q4_k_m"])
    assert cfg.output.export_type == "q4_k_m"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"q4_k_m.*pip install 'llamatrain\[quantize\]'"):
        load_config("tiny", ["output.export_type=q4_k_m"])
    load_config("tiny", ["output.export_type=q8_0"])  # native types need nothing

"""llamatrain.gguf.llama: the exact key/tensor set llama.cpp expects, round trips, errors.

llama.cpp itself reads these files in tests/integration/test_llama_cpp.py; here every property
is checked on the bytes we write, fast, without llama.cpp. Key types are read with the ``gguf``
package's own GGUFReader, independently of our reader.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from llamatrain.errors import GGUFError, TokenizerError
from llamatrain.gguf.file import read_gguf, read_gguf_metadata
from llamatrain.gguf.llama import (
    CONFIG_KEY,
    check_tensors,
    model_config_from_metadata,
    model_metadata,
    read_model,
    read_tokenizer,
    write_model,
    write_vocab,
)
from llamatrain.gguf.vocab import tokenizer_from_metadata, tokenizer_metadata
from llamatrain.model import Llama, ModelConfig
from llamatrain.ops.sets import AUTO
from llamatrain.tokenizer import SpmTokenizer, train_spm

EXPECTED_KEYS = {
    "general.architecture": "STRING",
    "general.name": "STRING",
    "general.file_type": "UINT32",
    "llama.context_length": "UINT32",
    "llama.embedding_length": "UINT32",
    "llama.block_count": "UINT32",
    "llama.feed_forward_length": "UINT32",
    "llama.attention.head_count": "UINT32",
    "llama.attention.head_count_kv": "UINT32",
    "llama.attention.layer_norm_rms_epsilon": "FLOAT32",
    "llama.rope.freq_base": "FLOAT32",
    "llama.rope.dimension_count": "UINT32",
    "llama.vocab_size": "UINT32",
    "llamatrain.model_config": "STRING",
    "tokenizer.ggml.model": "STRING",
    "tokenizer.ggml.tokens": "ARRAY STRING",
    "tokenizer.ggml.scores": "ARRAY FLOAT32",
    "tokenizer.ggml.token_type": "ARRAY INT32",
    "tokenizer.ggml.bos_token_id": "UINT32",
    "tokenizer.ggml.eos_token_id": "UINT32",
    "tokenizer.ggml.unknown_token_id": "UINT32",
    "tokenizer.ggml.add_bos_token": "BOOL",
    "tokenizer.ggml.add_eos_token": "BOOL",
    "tokenizer.ggml.add_space_prefix": "BOOL",
}
LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip
TEXT = "we said: the time is new\n  and the old day was   new\n"


def _text(n_lines: int = 600) -> str:
    rng = random.Random(0)
    words = ["the", "a", "of", "to", "and", "in", "it", "is", "was", "he", "she", "they", "we"]
    words += ["you", "said", "time", "day", "old", "new"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(n_lines))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> SpmTokenizer:
    path = tmp_path_factory.mktemp("gguf") / "corpus.txt"
    path.write_text(_text())
    return train_spm([path], vocab_size=320)


def make_model(tok: SpmTokenizer, seed: int = 0, **overrides) -> Llama:
    fields = dict(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=64, ops="torch")  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Llama(ModelConfig(**fields))
    with torch.no_grad():  # norms away from 1 so that a dropped/misnamed norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def export(model: Llama, tok: SpmTokenizer, path: Path, type: str = "f32") -> Path:
    return write_model(path, model.cfg, model.state_dict(), tok, type=type)


def load(path: Path) -> tuple[Llama, SpmTokenizer]:
    """What a caller of read_model does: build the Llama (with the torch op set) and fill it."""
    file = read_model(path)
    model = Llama(dataclasses.replace(file.config, ops="torch"))
    model.load_state_dict(file.tensors, strict=True)
    return model.eval(), file.tokenizer


def value_types(path: Path) -> dict[str, str]:
    fields = GGUFReader(path).fields.items()  # the header is listed too, as GGUF.* pseudo-keys
    return {n: " ".join(t.name for t in f.types) for n, f in fields if not n.startswith("GGUF.")}


def patch_tensor_type(path: Path, name: str, new_type: int) -> None:
    """Overwrite the GGML type of a tensor in its tensor-info record."""
    data = bytearray(path.read_bytes())
    i = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("tied", [False, True])
def test_key_and_tensor_set_is_what_llama_cpp_expects(tok, tmp_path: Path, tied: bool) -> None:
    model = make_model(tok, tie_embeddings=tied)
    path = export(model, tok, tmp_path / "m.gguf")
    assert value_types(path) == EXPECTED_KEYS
    meta, cfg = read_gguf_metadata(path), model.cfg
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == 0
    assert meta["llama.context_length"] == cfg.max_seq_len == 64
    assert meta["llama.embedding_length"] == cfg.dim == 64
    assert meta["llama.block_count"] == cfg.n_layers == 2
    assert meta["llama.feed_forward_length"] == cfg.hidden_dim == 192
    assert meta["llama.attention.head_count"] == cfg.n_heads == 4
    assert meta["llama.attention.head_count_kv"] == cfg.kv_heads == 2
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5
    assert meta["llama.rope.freq_base"] == 10000.0
    assert meta["llama.rope.dimension_count"] == cfg.head_dim == 16
    assert meta["llama.vocab_size"] == tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert json.loads(meta[CONFIG_KEY]) == cfg.architecture()
    assert "ops" not in json.loads(meta[CONFIG_KEY])  # a run choice, not the file's business
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    tensors = {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(path).tensors}
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{b}.{t}.weight" for b in range(cfg.n_layers) for t in LAYER_TENSORS
    }
    if not tied:
        expected.add("output.weight")
    assert set(tensors) == expected
    # ggml dims are fastest-first: a torch (out, in) Linear weight is stored as ne = {in, out}
    assert tensors["blk.0.attn_k.weight"] == (cfg.dim, cfg.kv_heads * cfg.head_dim)
    assert tensors["blk.0.ffn_down.weight"] == (cfg.hidden_dim, cfg.dim)
    assert tensors["token_embd.weight"] == (cfg.dim, tok.vocab_size)


@pytest.mark.parametrize(
    ("type_name", "matrix", "code"),
    [("f32", "F32", 0), ("f16", "F16", 1), ("bf16", "BF16", 32), ("q8_0", "Q8_0", 7),
     ("q4_0", "Q4_0", 2)],
)  # fmt: skip
def test_tensor_types_per_export_type(tok, tmp_path, type_name, matrix, code) -> None:
    path = export(make_model(tok), tok, tmp_path / "m.gguf", type=type_name)
    contents = read_gguf(path)
    for name, stored in contents.tensor_types.items():
        assert stored == ("F32" if name.endswith("norm.weight") else matrix), name
    assert contents.metadata["general.file_type"] == code
    data_bytes = sum(contents.tensor_nbytes.values())
    assert data_bytes < path.stat().st_size < data_bytes + 64 * 1024


def test_rows_not_divisible_by_32_fall_back_to_f16(tok, tmp_path: Path) -> None:
    model = make_model(tok, dim=48, n_heads=4, n_kv_heads=2, ffn_dim=64)
    with pytest.warns(UserWarning, match="not a multiple of 32"):
        path = export(model, tok, tmp_path / "m.gguf", type="q8_0")
    types = read_gguf(path).tensor_types
    assert types["blk.0.attn_q.weight"] == "F16"  # rows of 48
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 64
    assert types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(Exception, match="unknown GGUF type 'q5_k'"):
        export(model, tok, tmp_path / "x.gguf", type="q5_k")
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------------------------- round trips


def test_tokenizer_metadata_round_trip(tok: SpmTokenizer) -> None:
    back = tokenizer_from_metadata(tokenizer_metadata(tok))
    assert back.fingerprint() == tok.fingerprint()
    assert (back.bos_id, back.eos_id, back.unk_id, back.pad_id) == (1, 2, 0, None)
    assert back.pieces == tok.pieces and back.token_types == tok.token_types
    assert back.encode(TEXT, bos=True) == tok.encode(TEXT, bos=True)
    assert back.decode(tok.encode(TEXT)) == TEXT


def test_tokenizer_round_trip_keeps_pad_and_space_prefix(tok: SpmTokenizer, tmp_path) -> None:
    custom = SpmTokenizer(tok.pieces, tok.scores, tok.token_types, pad_id=3, add_space_prefix=False)
    path = write_vocab(tmp_path / "vocab.gguf", custom)
    back = read_tokenizer(path)
    assert back.fingerprint() == custom.fingerprint() != tok.fingerprint()
    assert back.pad_id == 3 and back.add_space_prefix is False
    assert read_gguf_metadata(path)["tokenizer.ggml.padding_token_id"] == 3
    assert back.encode(TEXT) == custom.encode(TEXT)


@pytest.mark.parametrize("framing", [(False, False), (False, True), (True, True)])
def test_tokenizer_round_trip_keeps_add_bos_and_add_eos(
    tok: SpmTokenizer, tmp_path, framing: tuple[bool, bool]
) -> None:
    """The file's add_bos_token / add_eos_token decide how a prompt is framed; written back,
    the keys keep their values, and a file without them gets llama.cpp's llama default."""
    framed = SpmTokenizer(
        tok.pieces, tok.scores, tok.token_types, add_bos=framing[0], add_eos=framing[1]
    )
    path = write_vocab(tmp_path / "vocab.gguf", framed)
    meta = read_gguf_metadata(path)
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]) == framing
    back = read_tokenizer(path)
    assert (back.add_bos, back.add_eos) == framing
    assert back.fingerprint() == framed.fingerprint() != tok.fingerprint()
    bos, eos = [tok.bos_id] * framing[0], [tok.eos_id] * framing[1]
    assert back.encode_prompt(TEXT) == [*bos, *tok.encode(TEXT), *eos]
    keys = tokenizer_metadata(framed)
    del keys["tokenizer.ggml.add_bos_token"], keys["tokenizer.ggml.add_eos_token"]
    default = tokenizer_from_metadata(keys)
    assert (default.add_bos, default.add_eos) == (True, False)
    assert default.fingerprint() == tok.fingerprint()


@pytest.mark.parametrize("tied", [False, True])
def test_model_config_round_trip(tok, tmp_path: Path, tied: bool) -> None:
    cfg = make_model(
        tok, tie_embeddings=tied, multiple_of=16, norm_eps=1e-6, rope_theta=5e5, n_kv_heads=None
    ).cfg
    tensors = Llama(cfg).state_dict()
    path = write_model(tmp_path / "m.gguf", cfg, tensors, tok)
    back = model_config_from_metadata(read_gguf(path))
    assert back.architecture() == cfg.architecture()
    assert back == dataclasses.replace(cfg, ops=AUTO, attention=AUTO)  # run choices: defaults
    assert model_metadata(back) == model_metadata(cfg)


def test_f32_round_trip_is_exact(tok, tmp_path: Path) -> None:
    model = make_model(tok, tie_embeddings=False, multiple_of=16, norm_eps=1e-6, rope_theta=5e5)
    loaded, tok2 = load(export(model, tok, tmp_path / "m.gguf"))
    assert loaded.cfg == model.cfg
    assert tok2.fingerprint() == tok.fingerprint()
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    x = torch.tensor([tok.encode("the old day", bos=True)])
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert tok2.encode(TEXT) == tok.encode(TEXT)


def test_tied_round_trip(tok, tmp_path: Path) -> None:
    model = make_model(tok, tie_embeddings=True)
    loaded, _ = load(export(model, tok, tmp_path / "t.gguf"))
    assert loaded.cfg.tie_embeddings and loaded.output is None
    assert torch.equal(loaded.token_embd.weight, model.token_embd.weight)


def test_foreign_file_config_from_llama_keys(tok, tmp_path: Path, patch) -> None:
    """Without our llamatrain.model_config key (a llama.cpp-written file) the config is rebuilt
    from the llama.* keys and tensor shapes alone."""
    model = make_model(tok)
    path = export(model, tok, tmp_path / "m.gguf")
    patch(path, b"llamatrain.model_config", b"llamatrain.model_cXnfig")
    loaded, _ = load(path)
    cfg = loaded.cfg
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hidden_dim) == (
        64, 2, 4, 2, model.cfg.hidden_dim)  # fmt: skip
    assert cfg.norm_eps == 1e-5 and cfg.rope_theta == 10000.0 and cfg.max_seq_len == 64
    assert cfg.vocab_size == tok.vocab_size and not cfg.tie_embeddings
    x = torch.tensor([[1, 5, 300, 17]])
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_recorded_config_ignores_run_choices_and_unknown_keys(tok, tmp_path: Path) -> None:
    """Older files recorded run choices (ops) and may hold fields that no longer exist: the
    architecture is taken from the file, the rest is the loading run's business."""
    model = make_model(tok)
    contents = read_gguf(export(model, tok, tmp_path / "m.gguf"))
    recorded = dict(model.cfg.architecture(), ops="torch", attention="softmax", retired=1)
    contents.metadata[CONFIG_KEY] = json.dumps(recorded)
    cfg = model_config_from_metadata(contents)
    assert cfg.architecture() == model.cfg.architecture()
    assert (cfg.ops, cfg.attention) == (AUTO, AUTO)  # the defaults, made by the run


@pytest.mark.parametrize(("type_name", "block_err", "logit_tol"), [
    ("f16", 1e-3, 1e-3), ("bf16", 8e-3, 2e-2), ("q8_0", 1 / 127, 2e-2), ("q4_0", 1 / 8, 0.3),
])  # fmt: skip
def test_lossy_round_trip_within_tolerance(tok, tmp_path, type_name, block_err, logit_tol):
    """Per-tensor error bounded by the format (q8_0: amax/127, q4_0: amax/8 per block,
    f16/bf16: relative rounding); logits stay close."""
    model = make_model(tok)
    loaded, _ = load(export(model, tok, tmp_path / "m.gguf", type=type_name))
    for k, w in model.state_dict().items():
        w2 = loaded.state_dict()[k]
        assert (w2 - w).abs().max() <= block_err * w.abs().max() + 1e-7, k
    x = torch.tensor([tok.encode("the old day was new and they said it", bos=True)])
    with torch.no_grad():
        diff = (model(x) - loaded(x)).abs().max().item()
    assert diff < logit_tol


def test_checkpoint_extras_round_trip(tok, tmp_path: Path) -> None:
    model = make_model(tok)
    moments = torch.randn(1000)
    extra_kv = {
        "training.iteration_count": 12345,
        "training.big": 2**40,
        "training.lr": 3e-4,
        "training.flag": True,
        "training.note": "héllo",
        "training.list": [1, 2, 3],
        "training.u32": np.uint32(7),
        "optimizer.type": "adam",
    }
    extra_tensors = {
        "optimizer.adam.first_moments": moments,
        "training.cursor": torch.arange(5, dtype=torch.int64),
    }
    path = write_model(tmp_path / "ckpt.gguf", model.cfg, model.state_dict(), tok,
                       extra_kv=extra_kv, extra_tensors=extra_tensors)  # fmt: skip
    file = read_model(path)
    for k, v in extra_kv.items():
        assert file.contents.metadata[k] == v, k
    assert torch.equal(file.contents.tensors["optimizer.adam.first_moments"], moments)
    assert file.contents.tensors["training.cursor"].tolist() == [0, 1, 2, 3, 4]
    assert file.tensors.keys() == model.state_dict().keys()  # extras are not weights
    assert torch.equal(file.tensors["output.weight"], model.output.weight)
    with pytest.raises(GGUFError, match="extra_kv key 'llama.block_count' collides"):
        write_model(tmp_path / "x.gguf", model.cfg, model.state_dict(), tok,
                    extra_kv={"llama.block_count": 3})  # fmt: skip
    with pytest.raises(GGUFError, match="extra tensor 'blk.9.x' would be read back as a model"):
        write_model(tmp_path / "x.gguf", model.cfg, model.state_dict(), tok,
                    extra_tensors={"blk.9.x": moments})  # fmt: skip
    assert not (tmp_path / "x.gguf").exists()


def test_vocab_only_file(tok, tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "vocab.gguf", tok)
    contents = read_gguf(path)
    assert not contents.tensors and contents.metadata["general.architecture"] == "llama"
    assert "llama.block_count" not in contents.metadata
    assert read_tokenizer(path).fingerprint() == tok.fingerprint()
    with pytest.raises(GGUFError, match="vocab-only GGUF.*read_tokenizer"):
        read_model(path)
    # a model file and a checkpoint are tokenizer sources too
    model_path = export(make_model(tok), tok, tmp_path / "m.gguf")
    assert read_tokenizer(model_path).fingerprint() == tok.fingerprint()


# ------------------------------------------------------------------------------ refusing to write


def test_refuses_to_write_what_llama_cpp_would_reject(tok, tmp_path: Path) -> None:
    model = make_model(tok)
    sd = dict(model.state_dict())
    target = tmp_path / "a.gguf"
    with pytest.raises(GGUFError, match=r"missing: \[\]; unexpected: \['blk.0.extra.weight'\]"):
        write_model(target, model.cfg, {**sd, "blk.0.extra.weight": torch.zeros(4)}, tok)
    with pytest.raises(GGUFError, match=r"missing: \['blk.1.ffn_up.weight'\]; unexpected: \[\]"):
        write_model(target, model.cfg, {k: v for k, v in sd.items() if "1.ffn_up" not in k}, tok)
    with pytest.raises(GGUFError, match=r"blk.0.attn_q.weight has shape \(64, 32\) but the con"):
        write_model(target, model.cfg, {**sd, "blk.0.attn_q.weight": torch.zeros(64, 32)}, tok)
    with pytest.raises(GGUFError, match="output_norm.weight has type I32; model weights must"):
        write_model(target, model.cfg, {**sd, "output_norm.weight": torch.ones(64).int()}, tok)
    other = make_model(tok, vocab_size=tok.vocab_size + 1)
    with pytest.raises(GGUFError, match="vocab_size 321 but the tokenizer has 320 tokens"):
        export(other, tok, target)
    no_context = dataclasses.replace(model.cfg, max_seq_len=None)
    with pytest.raises(GGUFError, match="the model config has no max_seq_len"):
        write_model(target, no_context, sd, tok)
    assert list(tmp_path.iterdir()) == []


def test_check_tensors_accepts_exactly_the_models_state_dict(tok) -> None:
    model = make_model(tok)
    check_tensors(model.cfg, model.state_dict(), "m.gguf")
    tied = dataclasses.replace(model.cfg, tie_embeddings=True)
    with pytest.raises(GGUFError, match=r"m.gguf: .*unexpected: \['output.weight'\]"):
        check_tensors(tied, model.state_dict(), "m.gguf")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_tensor_mismatch_names_the_models_family(tok, arch) -> None:
    """Issue 37: a qwen or gemma file's mismatch spoke of "the llama its config describes"."""
    model = make_model(tok, arch=arch)
    tensors = {k: v for k, v in model.state_dict().items() if k != "blk.0.attn_q_norm.weight"}
    with pytest.raises(GGUFError, match=f"not those of the {arch} its config") as info:
        check_tensors(model.cfg, tensors, "m.gguf")
    assert "llama" not in str(info.value).replace("Llama(config)", "")


# ------------------------------------------------------------------------------- reading errors


@pytest.fixture()
def model_file(tok, tmp_path: Path) -> Path:
    return export(make_model(tok), tok, tmp_path / "m.gguf")


def test_error_not_a_gguf(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am text")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_model(text)
    with pytest.raises(GGUFError, match="does not exist"):
        read_tokenizer(tmp_path / "missing.gguf")


def test_error_truncated(model_file: Path) -> None:
    data = model_file.read_bytes()
    model_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated"):
        read_model(model_file)


def test_error_unsupported_architecture(model_file: Path, patch) -> None:
    length = struct.pack("<Q", 5)
    patch(model_file, length + b"llama", length + b"gemma")
    with pytest.raises(GGUFError, match="'gemma' model; llamatrain supports the architectures"):
        read_model(model_file)


def test_error_unsupported_tensor_type(model_file: Path) -> None:
    patch_tensor_type(model_file, "output_norm.weight", 26)  # I32: same size, not a weight
    with pytest.raises(GGUFError, match="output_norm.weight has type I32; model weights must"):
        read_model(model_file)
    patch_tensor_type(model_file, "output_norm.weight", 99)
    with pytest.raises(GGUFError, match="unknown type id 99"):
        read_model(model_file)


def test_error_missing_key(model_file: Path, patch) -> None:
    patch(model_file, b"llama.block_count", b"llama.block_cOunt")
    with pytest.raises(GGUFError, match="lacks the required key.*llama.block_count"):
        read_model(model_file)


def test_error_no_tokenizer(model_file: Path, patch) -> None:
    patch(model_file, b"tokenizer.ggml.model", b"tokenizer.ggml.mOdel")
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        read_model(model_file)


def test_error_missing_and_unexpected_tensors(model_file: Path, patch) -> None:
    patch(model_file, b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight")
    with pytest.raises(
        GGUFError,
        match=r"missing: \['blk.1.ffn_up.weight'\]; unexpected: \['blk.1.ffn_uq.weight'\]",
    ):
        read_model(model_file)


def test_error_keys_disagree_with_the_recorded_config(model_file: Path) -> None:
    data = bytearray(model_file.read_bytes())
    i = data.index(b"llama.block_count") + len("llama.block_count") + 4
    struct.pack_into("<I", data, i, 3)  # claim 3 layers in the llama keys
    model_file.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"model_config disagrees .* on \['n_layers'\]"):
        read_model(model_file)


def set_float_key(path: Path, key: str, value: float) -> None:
    """Rewrite a FLOAT32 key's value in place (type 6 right after the name)."""
    data = bytearray(path.read_bytes())
    i = data.index(key.encode() + struct.pack("<I", 6)) + len(key) + 4
    struct.pack_into("<f", data, i, value)
    path.write_bytes(bytes(data))


GEMMA3 = dict(arch="gemma3", n_heads=4, n_kv_heads=2, final_logit_softcap=30.0)


@pytest.mark.parametrize("recorded", [True, False], ids=["ours", "foreign"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
@pytest.mark.parametrize(
    "key",
    ["attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
     "final_logit_softcapping", "rope.scale_linear"],
)  # fmt: skip
def test_hyper_parameter_keys_are_held_to_the_configs_rules(tok, tmp_path, patch, key, value,
                                                           recorded) -> None:  # fmt: skip
    """Issue 37, items 1 and 5: an infinite rms epsilon, rope base or soft-cap was taken as
    is (a soft-cap of inf then a traceback), a NaN or negative soft-cap read as "none" — the
    HF reader and --set refuse them all; now one rule, the config field's, for every source."""
    model = make_model(tok, **GEMMA3)
    extra = {"gemma3.rope.scale_linear": np.float32(1.0)}
    path = write_model(tmp_path / "m.gguf", model.cfg, model.state_dict(), tok, extra_kv=extra)
    if not recorded:
        patch(path, b"llamatrain.model_config", b"llamatrain.model_cXnfig")
    set_float_key(path, f"gemma3.{key}", value)
    with pytest.raises(GGUFError, match=r"invalid gemma3 model: model\.\w+ .*must be"):
        read_model(path)


def test_a_zero_soft_cap_key_is_llama_cpps_none(tok, tmp_path, patch) -> None:
    model = make_model(tok, **GEMMA3)
    path = export(model, tok, tmp_path / "m.gguf")
    patch(path, b"llamatrain.model_config", b"llamatrain.model_cXnfig")
    set_float_key(path, "gemma3.final_logit_softcapping", 0.0)
    assert read_model(path).config.final_logit_softcap is None


def test_error_rope_scaling_and_experts(tok, tmp_path: Path) -> None:
    model = make_model(tok)
    for extra, message in (
        ({"llama.rope.scaling.type": "yarn"}, "uses 'yarn' rope scaling"),
        ({"llama.expert_count": np.uint32(8)}, "mixture-of-experts"),
    ):
        path = write_model(tmp_path / "m.gguf", model.cfg, model.state_dict(), tok,
                           extra_kv=extra)  # fmt: skip
        with pytest.raises(GGUFError, match=message):
            read_model(path)

"""gguf_io: the exact key/tensor set llama.cpp expects, types, atomicity, round trips, errors.

llama.cpp itself reads these files in test_llama_cpp.py; here every property is checked on the
bytes we write, fast, without llama.cpp.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch

from llamatrain import gguf_io
from llamatrain.errors import GGUFError
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

# GGUF metadata value types (gguf.GGUFValueType), spelled out so the test needs no gguf import.
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9

EXPECTED_KEYS = {
    "general.architecture": STRING,
    "general.name": STRING,
    "general.file_type": UINT32,
    "llama.context_length": UINT32,
    "llama.embedding_length": UINT32,
    "llama.block_count": UINT32,
    "llama.feed_forward_length": UINT32,
    "llama.attention.head_count": UINT32,
    "llama.attention.head_count_kv": UINT32,
    "llama.attention.layer_norm_rms_epsilon": FLOAT32,
    "llama.rope.freq_base": FLOAT32,
    "llama.rope.dimension_count": UINT32,
    "llama.vocab_size": UINT32,
    "llamatrain.model_config": STRING,
    "tokenizer.ggml.model": STRING,
    "tokenizer.ggml.tokens": ARRAY,
    "tokenizer.ggml.scores": ARRAY,
    "tokenizer.ggml.token_type": ARRAY,
    "tokenizer.ggml.bos_token_id": UINT32,
    "tokenizer.ggml.eos_token_id": UINT32,
    "tokenizer.ggml.unknown_token_id": UINT32,
    "tokenizer.ggml.add_bos_token": BOOL,
    "tokenizer.ggml.add_eos_token": BOOL,
    "tokenizer.ggml.add_space_prefix": BOOL,
}
LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


def _text(n_lines: int = 600) -> str:
    rng = random.Random(0)
    words = ["the", "a", "of", "to", "and", "in", "it", "is", "was", "he", "she", "they", "we"]
    words += ["you", "said", "time", "day", "old", "new"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(n_lines))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("gguf") / "corpus.txt"
    path.write_text(_text())
    return Tokenizer.train([path], vocab_size=320)


def make_model(tok: Tokenizer, seed: int = 0, **overrides) -> Llama:
    cfg = dict(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
               max_seq_len=64)  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Llama(ModelConfig(**cfg), ops="torch")
    with torch.no_grad():  # norms away from 1 so that a dropped/misnamed norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def tensor_types(path: Path) -> dict[str, str]:
    return gguf_io.read_gguf(path).tensor_types


def patch(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first occurrence of ``old`` by ``new`` (same length) in a file."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    i = data.index(old)
    data[i : i + len(old)] = new
    path.write_bytes(bytes(data))


def patch_tensor_type(path: Path, name: str, new_type: int) -> None:
    """Overwrite the GGML type of a 1-D tensor in its tensor-info record."""
    data = bytearray(path.read_bytes())
    i = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("tied", [False, True])
def test_key_and_tensor_set_is_what_llama_cpp_expects(tok: Tokenizer, tmp_path: Path, tied):
    model = make_model(tok, tie_embeddings=tied)
    path = gguf_io.export_gguf(model, tok, tmp_path / "m.gguf")
    meta, vtypes, infos = gguf_io._parse(path)
    assert vtypes == EXPECTED_KEYS
    cfg = model.cfg
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == 0
    assert meta["llama.context_length"] == cfg.max_seq_len
    assert meta["llama.embedding_length"] == cfg.dim
    assert meta["llama.block_count"] == cfg.n_layers
    assert meta["llama.feed_forward_length"] == cfg.hidden_dim
    assert meta["llama.attention.head_count"] == cfg.n_heads
    assert meta["llama.attention.head_count_kv"] == cfg.kv_heads
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5
    assert meta["llama.rope.freq_base"] == 10000.0
    assert meta["llama.rope.dimension_count"] == cfg.head_dim
    assert meta["llama.vocab_size"] == tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    names = {i.name for i in infos}
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{b}.{t}.weight" for b in range(cfg.n_layers) for t in LAYER_TENSORS
    }
    if not tied:
        expected.add("output.weight")
    assert names == expected
    # ggml dims are fastest-first: a torch (out, in) Linear weight is stored as ne = {in, out}
    q = next(i for i in infos if i.name == "blk.0.attn_q.weight")
    assert q.np_shape == (cfg.dim, cfg.dim)
    k = next(i for i in infos if i.name == "blk.0.attn_k.weight")
    assert k.np_shape == (cfg.kv_heads * cfg.head_dim, cfg.dim)


@pytest.mark.parametrize(
    ("file_type", "matrix", "code"),
    [("f32", "F32", 0), ("f16", "F16", 1), ("bf16", "BF16", 32), ("q8_0", "Q8_0", 7),
     ("q4_0", "Q4_0", 2)],
)  # fmt: skip
def test_tensor_types_per_file_type(tok, tmp_path, file_type, matrix, code) -> None:
    path = gguf_io.export_gguf(make_model(tok), tok, tmp_path / "m.gguf", type=file_type)
    types = tensor_types(path)
    for name, t in types.items():
        assert t == ("F32" if name.endswith("norm.weight") else matrix), name
    assert gguf_io.read_gguf_metadata(path)["general.file_type"] == code
    c = gguf_io.read_gguf(path)
    data_bytes = sum(gguf_io.stored_nbytes(c, n) for n in c.tensors)
    assert data_bytes < path.stat().st_size < data_bytes + 64 * 1024


def test_rows_not_divisible_by_32_fall_back_to_f16(tok: Tokenizer, tmp_path: Path) -> None:
    model = make_model(tok, dim=48, n_heads=4, n_kv_heads=2, ffn_dim=64)
    with pytest.warns(UserWarning, match="not a multiple of 32"):
        path = gguf_io.export_gguf(model, tok, tmp_path / "m.gguf", type="q8_0")
    types = tensor_types(path)
    assert types["blk.0.attn_q.weight"] == "F16"  # rows of 48
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 64
    assert types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(Exception, match="unknown GGUF type"):
        gguf_io.export_gguf(model, tok, tmp_path / "x.gguf", type="q5_k")


# ---------------------------------------------------------------------------------- round trips


def test_f32_round_trip_is_exact(tok: Tokenizer, tmp_path: Path) -> None:
    model = make_model(tok, tie_embeddings=False, multiple_of=16, norm_eps=1e-6, rope_theta=5e5)
    path = gguf_io.export_gguf(model, tok, tmp_path / "m.gguf")
    loaded, tok2 = gguf_io.load_gguf(path, ops="torch")
    assert loaded.cfg == model.cfg
    assert tok2.fingerprint() == tok.fingerprint()
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    x = torch.tensor([tok.encode("the old day", bos=True)])
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    text = "we said: the time is new\n"
    assert tok2.encode(text) == tok.encode(text)


def test_tied_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    model = make_model(tok, tie_embeddings=True)
    loaded, _ = gguf_io.load_gguf(gguf_io.export_gguf(model, tok, tmp_path / "t.gguf"))
    assert loaded.cfg.tie_embeddings and loaded.output is None
    assert torch.equal(loaded.token_embd.weight, model.token_embd.weight)


def test_foreign_file_config_from_llama_keys(tok: Tokenizer, tmp_path: Path) -> None:
    """Without our llamatrain.model_config key (a llama.cpp-written file) the config is rebuilt
    from the llama.* keys and tensor shapes alone."""
    model = make_model(tok)
    path = gguf_io.export_gguf(model, tok, tmp_path / "m.gguf")
    patch(path, b"llamatrain.model_config", b"llamatrain.model_cXnfig")
    loaded, _ = gguf_io.load_gguf(path, ops="torch")
    cfg = loaded.cfg
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hidden_dim) == (
        64, 2, 4, 2, model.cfg.hidden_dim)  # fmt: skip
    assert cfg.norm_eps == 1e-5 and cfg.rope_theta == 10000.0 and cfg.max_seq_len == 64
    x = torch.tensor([[1, 5, 300, 17]])
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


@pytest.mark.parametrize(("file_type", "block_err", "logit_tol"), [
    ("f16", 1e-3, 1e-3), ("bf16", 8e-3, 2e-2), ("q8_0", 1 / 127, 2e-2), ("q4_0", 1 / 8, 0.3),
])  # fmt: skip
def test_lossy_round_trip_within_tolerance(tok, tmp_path, file_type, block_err, logit_tol):
    """Per-tensor error bounded by the format (q8_0: amax/127, q4_0: amax/8 per block,
    f16/bf16: relative rounding); logits stay close."""
    model = make_model(tok)
    path = gguf_io.export_gguf(model, tok, tmp_path / "m.gguf", type=file_type)
    loaded, _ = gguf_io.load_gguf(path, ops="torch")
    for k, w in model.state_dict().items():
        w2 = loaded.state_dict()[k]
        assert (w2 - w).abs().max() <= block_err * w.abs().max() + 1e-7, k
    x = torch.tensor([tok.encode("the old day was new and they said it", bos=True)])
    with torch.no_grad():
        diff = (model(x) - loaded(x)).abs().max().item()
    assert diff < logit_tol


def test_checkpoint_extras_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    import numpy as np

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
    path = gguf_io.write_gguf(
        tmp_path / "ckpt.gguf", model.cfg, model.state_dict(), tok,
        extra_kv=extra_kv,
        extra_tensors={"optimizer.adam.first_moments": moments,
                       "training.cursor": torch.arange(5, dtype=torch.int64)},
    )  # fmt: skip
    c = gguf_io.read_gguf(path)
    for k, v in extra_kv.items():
        assert c.metadata[k] == v, k
    assert torch.equal(c.tensors["optimizer.adam.first_moments"], moments)
    assert c.tensors["training.cursor"].tolist() == [0, 1, 2, 3, 4]
    loaded, _ = gguf_io.model_from_contents(c, ops="torch")  # optimizer tensors are not weights
    assert torch.equal(loaded.output.weight, model.output.weight)
    with pytest.raises(GGUFError, match="collides"):
        gguf_io.write_gguf(tmp_path / "x.gguf", model.cfg, model.state_dict(), tok,
                           extra_kv={"llama.block_count": 3})  # fmt: skip


def test_vocab_only_file(tok: Tokenizer, tmp_path: Path) -> None:
    path = gguf_io.write_vocab_gguf(tmp_path / "vocab.gguf", tok)
    c = gguf_io.read_gguf(path)
    assert c.is_vocab_only and c.metadata["general.architecture"] == "llama"
    t2 = Tokenizer.from_gguf(path)
    assert t2.fingerprint() == tok.fingerprint()
    assert Tokenizer.from_file(path).fingerprint() == tok.fingerprint()  # by magic
    with pytest.raises(GGUFError, match="vocab-only"):
        gguf_io.load_gguf(path)
    # a full model file is a tokenizer source too
    model_path = gguf_io.export_gguf(make_model(tok), tok, tmp_path / "m.gguf")
    assert Tokenizer.from_gguf(model_path).fingerprint() == tok.fingerprint()


# ------------------------------------------------------------------------------------ atomicity


def test_failed_write_leaves_no_file(tok: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    model = make_model(tok)
    target = tmp_path / "m.gguf"

    def crash(self, *args, **kwargs):
        self.fout[0].write(b"half a tensor")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_io.GGUFWriter, "write_tensors_to_file", crash)
    with pytest.raises(OSError, match="disk full"):
        gguf_io.export_gguf(model, tok, target)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp file
    monkeypatch.undo()
    gguf_io.export_gguf(model, tok, target)
    before = target.read_bytes()
    monkeypatch.setattr(gguf_io.GGUFWriter, "write_tensors_to_file", crash)
    with pytest.raises(OSError):
        gguf_io.export_gguf(make_model(tok, seed=1), tok, target)
    assert target.read_bytes() == before  # the old file survives a failed overwrite
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_refuses_to_write_what_llama_cpp_would_reject(tok: Tokenizer, tmp_path: Path) -> None:
    model = make_model(tok)
    sd = dict(model.state_dict())
    extra = dict(sd, **{"blk.0.extra.weight": torch.zeros(4)})
    with pytest.raises(GGUFError, match="unexpected"):
        gguf_io.write_gguf(tmp_path / "a.gguf", model.cfg, extra, tok)
    del sd["blk.1.ffn_up.weight"]
    with pytest.raises(GGUFError, match="missing"):
        gguf_io.write_gguf(tmp_path / "a.gguf", model.cfg, sd, tok)
    other = make_model(tok, vocab_size=tok.vocab_size + 1)
    with pytest.raises(GGUFError, match="vocab_size"):
        gguf_io.export_gguf(other, tok, tmp_path / "a.gguf")
    assert not (tmp_path / "a.gguf").exists()


# --------------------------------------------------------------------------------------- errors


@pytest.fixture()
def model_file(tok: Tokenizer, tmp_path: Path) -> Path:
    return gguf_io.export_gguf(make_model(tok), tok, tmp_path / "m.gguf")


def test_error_not_a_gguf(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="does not exist"):
        gguf_io.read_gguf(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am text")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        gguf_io.load_gguf(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        gguf_io.read_gguf(empty)


def test_error_truncated_or_corrupt(model_file: Path) -> None:
    data = model_file.read_bytes()
    for cut in (6, 30, len(data) // 3, len(data) - 10):
        model_file.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            gguf_io.load_gguf(model_file)
    model_file.write_bytes(data[:4] + b"\x03\x00\x00\x00" + b"\xff" * 16 + data[24:])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        gguf_io.read_gguf(model_file)
    model_file.write_bytes(data[:4] + b"\x07\x00\x00\x00" + data[8:])
    with pytest.raises(GGUFError, match="version 7"):
        gguf_io.read_gguf(model_file)


def test_error_unsupported_architecture(model_file: Path) -> None:
    patch(
        model_file,
        b"\x05\x00\x00\x00\x00\x00\x00\x00llama",
        b"\x05\x00\x00\x00\x00\x00\x00\x00gemma",
    )
    with pytest.raises(GGUFError, match="'gemma' model; llamatrain supports the 'llama'"):
        gguf_io.load_gguf(model_file)


def test_error_unsupported_tensor_type(model_file: Path) -> None:
    patch_tensor_type(model_file, "output_norm.weight", 26)  # I32: same size, not a weight
    with pytest.raises(GGUFError, match="output_norm.weight has type I32"):
        gguf_io.load_gguf(model_file)
    patch_tensor_type(model_file, "output_norm.weight", 99)
    with pytest.raises(GGUFError, match="unknown type id 99"):
        gguf_io.load_gguf(model_file)


def test_error_missing_key(model_file: Path) -> None:
    patch(model_file, b"llama.block_count", b"llama.block_cOunt")
    with pytest.raises(GGUFError, match="lacks the required key.*llama.block_count"):
        gguf_io.load_gguf(model_file)


def test_error_missing_and_unexpected_tensors(model_file: Path) -> None:
    patch(model_file, b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight")
    with pytest.raises(GGUFError, match=r"missing: \['blk.1.ffn_up.weight'\]; unexpected"):
        gguf_io.load_gguf(model_file)


def test_error_inconsistent_shapes(model_file: Path) -> None:
    # claim 3 layers in the llama keys: block 2 is missing
    data = bytearray(model_file.read_bytes())
    i = data.index(b"llama.block_count") + len("llama.block_count") + 4
    struct.pack_into("<I", data, i, 3)
    model_file.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="disagrees|missing"):
        gguf_io.load_gguf(model_file)

"""A QLoRA model's vocabulary tables kept as stored (``llamatrain.lora.FrozenTable``).

A model whose token table and lm head are Q4_0 blocks must compute what the same model with
those blocks decoded into float32 tables computes:

* the lookup: the decoded table's rows, bit for bit;
* the head, through the model (llama untied and tied, gemma3's soft cap; both op sets): the
  loss, the log-probs of ``logps_of`` and the logits, and the adapters' gradients, within
  ``TOL`` (relative to each compared tensor's largest entry): the table head sums its
  log-sum-exp a vocabulary chunk at a time (``ops.table_head``; measured <= 1.3e-7 on the
  values, <= 1.1e-6 on the adapters' gradients, through two blocks' backward);
* the export: ``merged_tensors`` defers each table, which a writer encodes a chunk of rows at
  a time without ever decoding it whole, to the same bytes; ``merge_lora`` has the decoded
  tables;
* the build: ``base_dtype = "quantized"`` keeps a file's quantized or F16 tables as stored (its
  bytes), an F32 one as it is; the other base types keep float32 tables.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from random_models import move_off_neutral

from llamatrain.gguf import file as gguf_file
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.llama import read_model, write_model
from llamatrain.gguf.write import DeferredTensor, write_gguf
from llamatrain.lora import (
    ALL_TARGETS,
    FrozenTable,
    apply_lora,
    lora_state_dict,
    merge_lora,
    merged_tensors,
    store_frozen_targets,
)
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_config import VOCAB_TABLES
from llamatrain.model_source import build_lora_base
from llamatrain.ops.dequantize import dequantize
from llamatrain.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    SpmTokenizer,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)

TOL = 4e-6
VOCAB = 40
ARCHS = {
    "llama": dict(arch="llama", tie_embeddings=False),
    "llama-tied": dict(arch="llama", tie_embeddings=True),
    "gemma3": dict(
        arch="gemma3",
        tie_embeddings=True,
        sliding_window=4,
        rope_theta_swa=500.0,
        final_logit_softcap=2.0,
    ),
}


def blocks_of(weight: torch.Tensor, qtype: str = "Q4_0") -> torch.Tensor:
    return torch.from_numpy(gguf_quants.quantize(weight.numpy(), GGMLQuantizationType[qtype]))


def models(arch: str, ops: str) -> tuple[Llama, Llama]:
    """A LoRA model with float32 tables and the same model with them as Q4_0 blocks (the
    float32 tables being those blocks decoded), its adapters random so that they matter."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32, ops=ops,
        **ARCHS[arch],
    )  # fmt: skip
    dense = apply_lora(move_off_neutral(Llama(cfg)), rank=4, alpha=8.0)
    with torch.no_grad():
        for name, tensor in lora_state_dict(dense).items():
            if name.endswith("lora_b"):
                tensor.normal_(0.0, 0.1)
    kept = copy.deepcopy(dense)
    state = dense.state_dict()
    tables = [name for name in VOCAB_TABLES if name in state]
    store_frozen_targets(kept, dict.fromkeys(tables, "Q4_0"))
    with torch.no_grad():
        for name in tables:
            blocks = blocks_of(state[name])
            kept.get_submodule(name.removesuffix(".weight")).weight.copy_(blocks)
            state[name].copy_(dequantize(blocks, "Q4_0", cfg.dim))
    return dense, kept


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100  # a prompt's rows, not scored
    return tokens[:, :-1], targets


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def value_and_grads(model: Llama, value: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    adapters = [p for p in model.parameters() if p.requires_grad]
    return value.detach(), list(torch.autograd.grad(value, adapters))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_a_lookup_is_the_decoded_tables_rows_bit_for_bit(qtype: str) -> None:
    weight = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(0))
    table = FrozenTable(torch.nn.Embedding(VOCAB, 64), qtype)
    table.weight.copy_(blocks_of(weight, qtype))
    ids = torch.tensor([[3, 0, 39, 3], [7, 7, 1, 12]])
    assert torch.equal(table(ids), dequantize(table.weight, qtype, 64)[ids])


@pytest.mark.usefixtures("decoded_products")
@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_head_over_blocks_is_the_head_over_the_decoded_tables(arch: str, ops: str) -> None:
    dense, kept = models(arch, ops)
    assert isinstance(kept.lm_head, FrozenTable)
    assert (kept.output is None) == kept.cfg.tie_embeddings  # tied: one table serves both
    tokens, targets = batch()
    for value in (
        lambda m: m.loss(tokens, targets),
        lambda m: (m(tokens, logps_of=targets) * torch.linspace(-1, 1, 12)).sum(),
    ):
        want, want_grads = value_and_grads(dense, value(dense))
        got, grads = value_and_grads(kept, value(kept))
        assert relative(got, want) <= TOL
        assert all(relative(g, w) <= TOL for g, w in zip(grads, want_grads, strict=True))
    with torch.no_grad():
        assert relative(kept(tokens), dense(tokens)) <= TOL


def test_the_export_streams_each_table_to_the_bytes_of_the_whole(tmp_path, monkeypatch) -> None:
    """Encoded 4 rows at a time from the blocks (``DeferredTensor.rows``), never decoded
    whole: the same Q8_0 bytes as the decoded table written at once."""
    dense, kept = models("llama", "ggml")
    monkeypatch.setattr(gguf_file, "CHUNK_VALUES", 4 * 64)
    tensors = merged_tensors(kept)
    for name in VOCAB_TABLES:
        table = tensors[name]
        assert isinstance(table, DeferredTensor) and table.shape == (VOCAB, 64)

        def never() -> torch.Tensor:
            raise AssertionError("the table was decoded whole")

        streamed = DeferredTensor(table.shape, table.dtype, never, table.rows)
        a = write_gguf(tmp_path / "a.gguf", "llama", {}, {name: (streamed, "q8_0")})
        b = write_gguf(tmp_path / "b.gguf", "llama", {}, {name: (table.read(), "q8_0")})
        assert torch.equal(read_gguf(a).tensors[name], read_gguf(b).tensors[name])
    merged, want = merge_lora(kept).state_dict(), merge_lora(dense).state_dict()
    assert all(torch.equal(merged[name], want[name]) for name in VOCAB_TABLES)


@pytest.mark.parametrize(
    ("file_type", "base_dtype", "kept"),
    [("q8_0", "quantized", "Q8_0"), ("f16", "quantized", "F16"), ("f32", "quantized", None),
     ("q8_0", "bf16", None)],
)  # fmt: skip
def test_a_quantized_run_builds_its_tables_as_the_file_stores_them(
    tmp_path, file_type: str, base_dtype: str, kept: str | None
) -> None:
    """``kept``: the stored type the tables are held in (None: float32, as before)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [TOKEN_TYPE_UNKNOWN] + [TOKEN_TYPE_CONTROL] * 2 + [TOKEN_TYPE_BYTE] * 256
    tokenizer = SpmTokenizer(pieces, [0.0] * len(pieces), types)
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=len(pieces),
                      max_seq_len=32)  # fmt: skip
    path = write_model(tmp_path / "m.gguf", cfg, Llama(cfg).state_dict(), tokenizer,
                       type=file_type)  # fmt: skip
    header = read_gguf(path, tensor_data=False)
    model = build_lora_base(read_model(header, tensor_data=False), base_dtype, ALL_TARGETS)
    for name in VOCAB_TABLES:
        table = model.get_submodule(name.removesuffix(".weight"))
        if kept is None:
            assert not isinstance(table, FrozenTable) and table.weight.dtype == torch.float32
        else:
            assert isinstance(table, FrozenTable) and header.tensor_types[name] == kept
            assert table.weight.nbytes == header.tensor_nbytes[name]

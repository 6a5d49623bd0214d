"""QLoRA: ``[lora] base_dtype = "quantized"`` trains adapters over a base kept in its blocks.

A small random llama (every row a multiple of 256 values, so K-quants apply) is exported
Q4_0 (gguf-py's quantizer) and Q4_K_M (llama.cpp's, ``llama_model_quantize``). What a run over
it must show:

* same numbers, other storage: its losses are those of a ``base_dtype = "f32"`` run over the
  same weights dequantized to an f32 file (``LOSS_RTOL``);
* the adapter it writes runs in llama.cpp over the quantized file and computes what our
  quantized-base model computes (``LOGIT_BOUND``);
* the adapted projections are held at the file's size: their buffers' bytes are the file's
  bytes of those tensors, a quarter (Q8) to an eighth (Q4) of float32; so are the token
  table and the lm head (``lora.FrozenTable``);
* a run may resume with another ``base_dtype`` (the adapter does not depend on how the base
  is stored): a quantized run resumed as f32 over the same file continues with its losses.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from file_mappings import mapped_ranges
from llama_cpp_runs import cpp_logits
from random_models import tiny_llama, unit_scaled

from llamatrain import api, model_source
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.device import amx_bf16
from llamatrain.gguf.export_types import merged_export_type
from llamatrain.gguf.file import read_gguf
from llamatrain.lora import FrozenTable, LoraLinear, decoded_base, lora_modules
from llamatrain.memory import plan_memory
from llamatrain.model import Llama
from llamatrain.model_config import VOCAB_TABLES
from llamatrain.objectives.grpo import rollout as grpo_rollout
from llamatrain.objectives.grpo.rollout import sample_completions
from llamatrain.ops import decode_kernels
from llamatrain.ops import lora as ops_lora
from llamatrain.sampling import SamplingParams
from llamatrain.trainer import held_types

pytestmark = pytest.mark.usefixtures("decoded_products_module")
"""Same numbers as the f32 copy (LOSS_RTOL) hold for the decoded path's float32 products: the
quantized kernels (ops.quantized_matmul) round x to 8 bits, as llama.cpp does; they are held
to their own references in tests/unit/test_quantized_matmul.py."""

STEPS = 4
LOSS_RTOL = 1e-5
"""The two runs multiply by the same float32 weights; the quantized one widens W a chunk of
rows at a time (the Q4_0 run in chunks of 32-64 rows) and sums dx over the chunks, and its
head sums the log-sum-exp a chunk of 64 vocabulary rows at a time (``ops.table_head``), so
only summation order differs. Measured: 8.7e-8 relative over 4 steps (1.5e-7 when the tables
were float32: one float32 ulp of the loss either way); 1e-5 leaves room for that to grow
through the updates, while a wrong block (an error of the quantization's size, ~7%) moves
the loss by far more."""
LOGIT_BOUND = {"q4_0": 0.04, "q4_k_m": 0.045}
"""Max |llama.cpp's logit (quantized file + our adapter) - ours (quantized base + adapter)|.
Not zero: llama.cpp rounds the activations to 8 bits for its quantized matmuls (Q8_0 for
Q4_0, Q8_K for K-quants), we multiply by the dequantized weights in float32 (see
test_quantized_import's LOGIT_BOUND_VS_FILE). Measured (48 tokens, logits up to 4.5 and
5.3, which the adapter moves by 6.8 and 6.2): q4_0 0.027, q4_k_m 0.030; the bounds are 1.5x
that."""


def qlora_overrides(
    cache_dir: Path, run_dir: Path, base: Path, base_dtype: str, dtype: str | None = "float32"
) -> list[str]:
    """A few steps of rank-4 LoRA on every projection of ``base``, a checkpoint every 2, in
    float32 (compared value for value with float32 LoRA runs), or ``dtype`` (None: the run's
    own choice, ``train.dtype = "auto"``: a QLoRA run's is bf16 on a CPU with AMX)."""
    pinned = [] if dtype is None else [f'train.dtype="{dtype}"']
    return [
        *pinned,
        f'data.cache_dir="{cache_dir}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{base}"',
        "lora.rank=4",
        "lora.alpha=8.0",
        f'lora.base_dtype="{base_dtype}"',
        f"train.steps={STEPS}",
        "train.n_batch=128",
        "train.save_every=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "output.export=false",
        "optim.lr=3e-2",
        "optim.warmup_steps=1",
    ]


@pytest.fixture(scope="module")
def f32_base(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A random llama with the tiny config's vocabulary, rows of 256 and 512 values, its
    matrices at the scale that keeps activations ~1 (so every block moves the logits)."""
    model, tokenizer = tiny_llama(
        cache_dir, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512
    )
    unit_scaled(model)
    return api.export_gguf(model, tokenizer, tmp_path_factory.mktemp("qlora") / "f32.gguf")


@pytest.fixture(scope="module")
def quantized_bases(f32_base: Path) -> dict[str, Path]:
    """type -> ``f32_base`` exported as that type (lazily: Q4_K_M goes through llama.cpp)."""

    class Bases(dict[str, Path]):
        def __missing__(self, name: str) -> Path:
            model, tokenizer = api.load_gguf(f32_base)
            path = api.export_gguf(model, tokenizer, f32_base.with_name(f"{name}.gguf"), type=name)
            self[name] = path
            return path

    return Bases()


@pytest.fixture(scope="module")
def q4_0_run(tmp_path_factory, cache_dir, quantized_bases) -> api.FitResult:
    run_dir = tmp_path_factory.mktemp("q4_0") / "run"
    overrides = qlora_overrides(cache_dir, run_dir, quantized_bases["q4_0"], "quantized")
    # 32-64 rows a chunk: W widened in 4-16 parts, the 384-row vocabulary tables in 6
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops_lora, "CHUNK_BYTES", 1 << 16)
        return api.fit("tiny", overrides=overrides, progress=False)


def losses(result: api.FitResult) -> np.ndarray:
    return np.array([record["loss"] for record in result.history.train])


def test_the_quantized_base_trains_like_its_dequantized_f32_copy(
    q4_0_run, quantized_bases, cache_dir, tmp_path
) -> None:
    model, tokenizer = api.load_gguf(quantized_bases["q4_0"])
    dequantized = api.export_gguf(model, tokenizer, tmp_path / "dequantized-f32.gguf")
    f32_run = api.fit(
        "tiny", overrides=qlora_overrides(cache_dir, tmp_path / "run", dequantized, "f32"),
        progress=False,
    )  # fmt: skip
    ours, theirs = losses(q4_0_run), losses(f32_run)
    assert len(ours) == STEPS and ours[-1] < ours[0]  # it trains
    np.testing.assert_allclose(ours, theirs, rtol=LOSS_RTOL)


def test_compiled_decoders_train_the_same_run_bit_for_bit(
    q4_0_run, quantized_bases, cache_dir, tmp_path, monkeypatch
) -> None:
    """``lora.decode = "compiled"`` (the blocks decoded by inductor's kernels, ``ops.
    decode_kernels``) gives the run of the eager decoders exactly: the same values, the same
    products. Its losses equal ``q4_0_run``'s (``"auto"``: eager at this size)."""
    traced = []  # a kernel's Python body runs when dynamo traces it
    arguments, kernel, shape = decode_kernels._KERNELS["Q4_0"]
    counted = (arguments, lambda *a: traced.append(1) or kernel(*a), shape)
    monkeypatch.setitem(decode_kernels._KERNELS, "Q4_0", counted)
    monkeypatch.setattr(decode_kernels, "_compiled", {})  # compiled again, counted
    overrides = qlora_overrides(cache_dir, tmp_path / "run", quantized_bases["q4_0"], "quantized")
    monkeypatch.setattr(ops_lora, "CHUNK_BYTES", 1 << 16)  # as q4_0_run's
    compiled = api.fit("tiny", overrides=[*overrides, 'lora.decode="compiled"'], progress=False)
    assert traced  # the Q4_0 blocks went through the compiled kernel
    np.testing.assert_array_equal(losses(compiled), losses(q4_0_run))


def test_the_adapted_projections_are_held_at_the_files_size(q4_0_run, quantized_bases) -> None:
    contents = read_gguf(quantized_bases["q4_0"], tensor_data=False)
    held = file_bytes = f32_bytes = 0
    for name, module in lora_modules(q4_0_run.model):
        assert module.qtype == contents.tensor_types[f"{name}.weight"] == "Q4_0"
        assert module.weight.dtype == torch.uint8 and not module.weight.requires_grad
        held += module.weight.nbytes
        file_bytes += contents.tensor_nbytes[f"{name}.weight"]
        f32_bytes += 4 * module.lora_b.shape[0] * module.lora_a.shape[1]
    assert held == file_bytes and held * 7 < f32_bytes  # Q4_0: 18 bytes per 32 values


def test_the_vocabulary_tables_are_held_as_the_files_blocks(q4_0_run, quantized_bases) -> None:
    """The token table and the lm head as their Q4_0 blocks, not widened to float32."""
    contents = read_gguf(quantized_bases["q4_0"], tensor_data=False)
    model = q4_0_run.model
    for name in VOCAB_TABLES:
        table = model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(table, FrozenTable) and table.qtype == contents.tensor_types[name]
        assert table.weight.dtype == torch.uint8
        assert table.weight.nbytes == contents.tensor_nbytes[name]
    assert model.lm_head is model.output


def test_the_memory_plan_counts_the_weights_the_run_holds(q4_0_run) -> None:
    """The opening summary's weights are the bytes the model holds: the blocks of the adapted
    projections and of the vocabulary tables, float32 for the rest (adapters aside)."""
    model = q4_0_run.model
    cfg = q4_0_run.config
    held = {t.data_ptr(): t.nbytes for n, t in model.state_dict().items() if "lora_" not in n}
    assert plan_memory(cfg, model.cfg, held_types(model)).weights == sum(held.values())


def test_the_frozen_base_is_mapped_from_its_file_not_copied(q4_0_run, quantized_bases) -> None:
    """Every weight kept as stored (adapted projections and vocabulary tables) lies in the
    file's own pages, as llama.cpp maps a model, holding the file's bytes at its offset."""
    path = quantized_bases["q4_0"]
    contents, ranges = read_gguf(path, tensor_data=False), mapped_ranges(path)
    data = path.read_bytes()
    kept = {f"{name}.weight": m.weight for name, m in lora_modules(q4_0_run.model)}
    kept |= {name: q4_0_run.model.get_submodule(name.removesuffix(".weight")).weight
             for name in VOCAB_TABLES}  # fmt: skip
    assert ranges and len(kept) == 2 * 7 + 2
    for name, weight in kept.items():
        start, end = weight.data_ptr(), weight.data_ptr() + weight.nbytes
        assert any(lo <= start and end <= hi for lo, hi in ranges), name
        info = contents.infos[name]
        assert weight.numpy().tobytes() == data[info.offset : info.offset + info.n_bytes]


def our_logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].double().numpy()


def test_decoding_token_by_token_holds_the_stored_base_decoded_once(q4_0_run, monkeypatch):
    """``lora.decoded_base``: within it every stored weight (projections and tables) is its
    float32 decode, the model computes what it computes over the blocks (to float32 matmul
    rounding), and on exit the very stored tensors are back; all or none by the budget. A
    GRPO rollout samples through it: greedy completions are the same tokens either way."""
    model = q4_0_run.model.eval()
    stored = {name: (m.weight, m.qtype) for name, m in lora_modules(model)}
    tables = [m for m in model.modules() if isinstance(m, FrozenTable)]  # embedding, head
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        over_blocks = model(ids)
        with decoded_base(model, 1 << 40) as held:
            decoded_tables = sum(4 * t.weight.numel() for t in tables)
            assert (
                held == sum(4 * m.weight.numel() for _, m in lora_modules(model)) + decoded_tables
            )
            for name, m in lora_modules(model):
                assert m.qtype is None and m.weight.dtype == torch.float32
                expected = ops_lora.dense_weight(*stored[name], m.lora_a.shape[1])
                assert torch.equal(m.weight, expected)
            decoded = model(ids)
        with decoded_base(model, held - 1) as none:
            assert none == 0 and all(m.qtype == "Q4_0" for _, m in lora_modules(model))
    assert all(m.weight is stored[n][0] and m.qtype == stored[n][1] for n, m in lora_modules(model))
    assert len(tables) == 2 and all(
        t.qtype == "Q4_0" and t.weight.dtype == torch.uint8 for t in tables
    )
    torch.testing.assert_close(decoded, over_blocks, rtol=0, atol=1e-4)

    prompts = [[1, 5, 9], [1, 42, 7, 3, 8]]
    greedy = SamplingParams(temperature=0.0)

    def rollout() -> list[list[int]]:
        completions = sample_completions(model, prompts, 8, greedy, frozenset({2}), lambda i: i)
        return [c.tokens for c in completions]

    with_decoded = rollout()
    monkeypatch.setattr(grpo_rollout, "_decoding_budget", lambda model, rows: 0)
    assert rollout() == with_decoded


def test_a_rollout_the_kernels_serve_decodes_nothing(q4_0_run, monkeypatch):
    """With the quantized kernels on, a float32 rollout of any number of rows (their forward
    has no row limit in float32: ``ops.quantized_matmul.max_rows``) samples over the stored
    blocks: no decoded float32 base is held (``lora.kernels_serve``, faster and the file's
    size); with the kernels off it decodes the base when it fits, as before."""
    from llamatrain.ops.kernel_build import load_kernels
    from llamatrain.ops.quantized_matmul import max_rows

    model = q4_0_run.model.eval()
    assert grpo_rollout._decoding_budget(model, 4) is not None  # this module: kernels off
    monkeypatch.setenv("LLAMATRAIN_KERNELS", "1")
    load_kernels.cache_clear()
    try:
        assert load_kernels() is not None, "no C++ compiler here: the kernels cannot build"
        assert max_rows("forward") is None
        assert grpo_rollout._decoding_budget(model, 4096) is None
    finally:
        monkeypatch.setenv("LLAMATRAIN_KERNELS", "0")
        load_kernels.cache_clear()


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k_m"])
def test_llama_cpp_runs_the_adapter_over_the_quantized_file_like_we_do(
    qtype, q4_0_run, quantized_bases, cache_dir, tmp_path
) -> None:
    import llama_cpp

    if qtype == "q4_0":
        run = q4_0_run
    else:  # as a user starts it: bf16 compute on a CPU with AMX, float32 elsewhere
        base = quantized_bases[qtype]
        overrides = qlora_overrides(cache_dir, tmp_path / "run", base, "quantized", dtype=None)
        run = api.fit("tiny", overrides=overrides, progress=False)
        assert run.config.train.dtype == ("bfloat16" if amx_bf16() else "float32")
    ids = run.tokenizer.encode(SONNETS_PATH.read_text()[:400], bos=True)[:48]
    ours = our_logits(run.model, ids)
    theirs = cpp_logits(llama_cpp, quantized_bases[qtype], ids, lora=run.adapter_path)
    without = cpp_logits(llama_cpp, quantized_bases[qtype], ids)
    assert np.abs(theirs - without).max() > 0.1  # the adapter matters
    assert np.abs(ours - theirs).max() < LOGIT_BOUND[qtype]


def test_a_quantized_run_resumes_as_f32_over_the_same_file(
    q4_0_run, quantized_bases, cache_dir, tmp_path
) -> None:
    run_dir = tmp_path / "run"
    overrides = qlora_overrides(cache_dir, run_dir, quantized_bases["q4_0"], "quantized")
    checkpoint = q4_0_run.run_dir / "checkpoints" / f"step-{2:07d}.gguf"
    resumed_overrides = [o for o in overrides if not o.startswith("lora.base_dtype")]
    resumed = api.fit(
        "tiny", overrides=[*resumed_overrides, 'lora.base_dtype="f32"'], resume=checkpoint,
        progress=False,
    )  # fmt: skip
    np.testing.assert_allclose(losses(resumed), losses(q4_0_run)[2:], rtol=LOSS_RTOL)
    assert not any(m.qtype for _, m in lora_modules(resumed.model))


# ---- the export at the end of a run ------------------------------------------------------


class MergedWeights:
    """Counts the merged weights alive while a model is written (through weakrefs): a
    streamed merge has one at a time, and none once the write is done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live = self.peak = 0
        merged_weight = LoraLinear.merged_weight

        def counted(module: LoraLinear, *rows: int | None) -> torch.Tensor:
            weight = merged_weight(module, *rows)
            self.live += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(weight, self._dropped)
            return weight

        monkeypatch.setattr(LoraLinear, "merged_weight", counted)

    def _dropped(self) -> None:
        self.live -= 1


MERGED_Q8_BOUND = 0.15
"""Max |llama.cpp's logit of the merged Q8_0 export - ours (Q4_0 base + adapter)|. Two roundings:
Q8_0 stores every matrix (the embeddings too) at 1/127 of its block's largest value, and
llama.cpp rounds activations to 8 bits for its Q8_0 matmuls. Measured 0.090 (48 tokens; our
own float32 forward of the same file is 0.064 from ours, llama.cpp 0.049 from that); the
adapter moves these logits by 5.0, so a merge that lost or misscaled it fails by far."""


def test_a_quantized_runs_merged_export_is_q8_0_written_a_tensor_at_a_time(
    quantized_bases, cache_dir, tmp_path, monkeypatch
) -> None:
    """``output.export_type = "auto"`` over a Q4_0 base exports the merged model as Q8_0 (a
    4-bit requantization would round the update away), after the adapter; each merged weight
    exists only while it is written; llama.cpp runs the file as our adapted model computes."""
    import llama_cpp

    merged = MergedWeights(monkeypatch)
    overrides = qlora_overrides(cache_dir, tmp_path / "run", quantized_bases["q4_0"], "quantized")
    overrides = [*(o for o in overrides if not o.startswith("output.export")), "train.steps=2"]
    run = api.fit("tiny", overrides=overrides, progress=False)
    assert run.config.output.export_type == "q8_0"
    assert 'export_type = "q8_0"' in (run.run_dir / "config.toml").read_text()
    assert run.export_path == run.run_dir / "model-q8_0.gguf"
    assert run.adapter_path.stat().st_mtime_ns <= run.export_path.stat().st_mtime_ns
    types = read_gguf(run.export_path, tensor_data=False).tensor_types
    assert {types[f"{name}.weight"] for name, _ in lora_modules(run.model)} == {"Q8_0"}
    assert merged.peak == 1 and merged.live == 0  # one merged weight at a time, none kept

    ids = run.tokenizer.encode(SONNETS_PATH.read_text()[:400], bos=True)[:48]
    ours = our_logits(run.model, ids)
    without = cpp_logits(llama_cpp, quantized_bases["q4_0"], ids)
    assert np.abs(ours - without).max() > 0.1  # the adapter matters
    assert np.abs(cpp_logits(llama_cpp, run.export_path, ids) - ours).max() < MERGED_Q8_BOUND


@pytest.mark.parametrize(
    ("base_types", "rows", "chosen"),
    [
        (None, [64], "f32"),  # no LoRA base: the float32 weights trained
        (["F16", "F16"], [64], "f16"),  # the base's own float type
        (["BF16"], [64], "bf16"),
        (["F32"], [48], "f32"),
        ([], [64], "f16"),  # an HF folder: convert_hf_to_gguf's default
        (["Q4_K", "Q6_K"], [64], "q8_0"),  # quantized: q8_0, never 4 bits again
        (["Q4_0"], [64, 48], "f16"),  # rows that are not whole Q8_0 blocks
        (["F16", "Q8_0"], [64], "q8_0"),
    ],
)
def test_auto_export_types(base_types, rows, chosen) -> None:
    assert merged_export_type(base_types, rows) == chosen


def test_exporting_a_lora_run_merges_over_the_base_as_its_file_stores_it(
    q4_0_run, tmp_path, monkeypatch
) -> None:
    """``llamatrain export RUN`` holds the run's base as its file stores it (Q4_0 blocks, every
    matrix mapped) and merges one weight at a time as it writes; the file is the merged
    float32 model ``load(..., dequantize=True)`` gives."""
    mapped: list[str] = []
    map_stored = model_source.map_stored
    monkeypatch.setattr(
        model_source, "map_stored", lambda h, like: mapped.extend(like) or map_stored(h, like)
    )
    merged = MergedWeights(monkeypatch)
    path = api.export(q4_0_run.run_dir, tmp_path / "merged.gguf", type="f32")
    assert merged.peak == 1 and merged.live == 0
    types = read_gguf(q4_0_run.config.model.init_from, tensor_data=False).tensor_types
    assert sorted(mapped) == sorted(name for name, t in types.items() if t == "Q4_0")
    exported = read_gguf(path).tensors
    loaded, _ = api.load(q4_0_run.run_dir, dequantize=True)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(exported[name], tensor), name


def test_exporting_a_quantized_run_names_no_type_and_gets_the_runs_own_q8_0(
    q4_0_run, tmp_path, capsys
) -> None:
    """``llamatrain export RUN`` with no ``--type`` writes what the run chose for its own export
    (its config.toml's ``output.export_type``: q8_0 over a Q4_0 base), never a silent float32
    4x the base's size; a model file with no type stays f32."""
    out = tmp_path / "merged.gguf"
    assert main(["export", str(q4_0_run.run_dir), "-o", str(out)]) == 0
    assert "q8_0)" in capsys.readouterr().out
    types = read_gguf(out, tensor_data=False).tensor_types
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q8_0"
    again = tmp_path / "again.gguf"
    assert main(["export", str(out), "-o", str(again)]) == 0
    assert read_gguf(again, tensor_data=False).tensor_types["blk.0.attn_q.weight"] == "F32"

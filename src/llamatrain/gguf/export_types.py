"""The export-type catalogue: which GGUF tensor types llamatrain writes, and how.

What a model can be exported as is product knowledge, not the container's: ``EXPORT_TYPES``
are written here, tensor by tensor, by ``llamatrain.gguf.file``; ``QUANTIZER_TYPES`` only
through llama.cpp's own quantizer (``llamatrain.gguf.quantize``). Config checks, the CLI's
``--type`` choices and the writers all take their names from this one list, so adding a type
is one edit here.

The codes are gguf's own enums (``GGMLQuantizationType``, ``LlamaFileType``), imported here
rather than copied, so a type's number can never drift from llama.cpp's; apart from
``llamatrain.gguf.file`` and ``llamatrain.gguf.header``, this is the only module that
imports the ``gguf`` package, and it takes nothing from it but those enums.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from gguf import GGMLQuantizationType, LlamaFileType

from llamatrain.errors import ConfigError

__all__ = [
    "ALL_EXPORT_TYPES",
    "EXPORT_TYPES",
    "FILE_TYPES",
    "QUANTIZER_TYPES",
    "AUTO_EXPORT_TYPE",
    "RUN_EXPORT_TYPES",
    "check_export_type",
    "general_file_type",
    "merged_export_type",
]

_T = GGMLQuantizationType

FILE_TYPES: dict[str, tuple[GGMLQuantizationType, int]] = {
    "f32": (_T.F32, int(LlamaFileType.ALL_F32)),
    "f16": (_T.F16, int(LlamaFileType.MOSTLY_F16)),
    "bf16": (_T.BF16, int(LlamaFileType.MOSTLY_BF16)),
    "q8_0": (_T.Q8_0, int(LlamaFileType.MOSTLY_Q8_0)),
    "q4_0": (_T.Q4_0, int(LlamaFileType.MOSTLY_Q4_0)),
}
"""Export type name -> (the GGML type matrices are stored as, its ``general.file_type``)."""

EXPORT_TYPES: tuple[str, ...] = tuple(FILE_TYPES)
"""The type names a tensor can be written as (by ``llamatrain.gguf.file``, tensor by tensor),
for config checks."""

_F = LlamaFileType
QUANTIZER_TYPES: dict[str, int] = {
    "q4_1": int(_F.MOSTLY_Q4_1),
    "q5_0": int(_F.MOSTLY_Q5_0),
    "q5_1": int(_F.MOSTLY_Q5_1),
    "q2_k": int(_F.MOSTLY_Q2_K),
    "q3_k_s": int(_F.MOSTLY_Q3_K_S),
    "q3_k_m": int(_F.MOSTLY_Q3_K_M),
    "q3_k_l": int(_F.MOSTLY_Q3_K_L),
    "q4_k_s": int(_F.MOSTLY_Q4_K_S),
    "q4_k_m": int(_F.MOSTLY_Q4_K_M),
    "q5_k_s": int(_F.MOSTLY_Q5_K_S),
    "q5_k_m": int(_F.MOSTLY_Q5_K_M),
    "q6_k": int(_F.MOSTLY_Q6_K),
    "iq4_nl": int(_F.MOSTLY_IQ4_NL),
    "iq4_xs": int(_F.MOSTLY_IQ4_XS),
}
"""Export type name -> llama.cpp ftype (``general.file_type``) of the types only llama.cpp's
quantizer writes (``llamatrain.gguf.quantize``): the K-quants' encoders are search heuristics
that gguf-py does not implement. They mix types per tensor as ``llama-quantize`` does (Q4_K_M
keeps some matrices Q6_K). Left out: the IQ1/IQ2/IQ3 types and Q2_K_S, which need an
importance matrix (llama.cpp refuses the first without one), and types our reader cannot read
back (Q1_0) or that suit only models trained for them (TQ1_0, TQ2_0, MXFP4)."""

ALL_EXPORT_TYPES: tuple[str, ...] = EXPORT_TYPES + tuple(QUANTIZER_TYPES)
"""Every type a model can be exported as: ``EXPORT_TYPES`` then ``QUANTIZER_TYPES``; the
choices of ``llamatrain export --type`` and ``llamatrain.export_gguf``."""


def check_export_type(type_name: str) -> None:
    """Raise ConfigError unless ``type_name`` is one of ``EXPORT_TYPES``."""
    if type_name in QUANTIZER_TYPES:
        raise ConfigError(
            f"GGUF type {type_name!r} is written by llama.cpp's quantizer, not tensor by tensor; "
            "export the model with llamatrain.export_gguf or `llamatrain export --type`"
        )
    if type_name not in FILE_TYPES:
        raise ConfigError(
            f"unknown GGUF type {type_name!r}; choose one of {', '.join(ALL_EXPORT_TYPES)}"
        )


def general_file_type(type_name: str) -> int:
    """The ``general.file_type`` code of an export type (llama.cpp reports it as the ftype)."""
    check_export_type(type_name)
    return FILE_TYPES[type_name][1]


AUTO_EXPORT_TYPE = "auto"
"""``output.export_type``'s default: the type chosen for the run's base (see
:func:`merged_export_type`)."""

RUN_EXPORT_TYPES: tuple[str, ...] = (AUTO_EXPORT_TYPE, *ALL_EXPORT_TYPES)
"""The choices of ``output.export_type``: a type, or ``auto``."""

_FLOAT_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_BLOCK = 32  # values per Q8_0 block


def merged_export_type(base_types: Collection[str] | None, row_lengths: Iterable[int]) -> str:
    """What ``output.export_type = "auto"`` writes a run's model as.

    ``base_types``: the ggml types of the adapted matrices in a LoRA run's base GGUF (empty
    for an HF folder, None for a run without a base or a full finetune). ``row_lengths``:
    of the model's matrices.

    - No LoRA base: ``f32``, the float32 weights that were trained.
    - A base whose adapted matrices are one float type: that type, the base's own size.
    - An HF folder: ``f16``, the default of llama.cpp's ``convert_hf_to_gguf.py``.
    - A quantized base: ``q8_0``, never its own 4-bit type. Merging adds s·B·A, an update far
      below a 4-bit block's step: requantized as Q4_0 a merged weight is off by ~1.06× the
      whole update when the update is 3% of the weight (Q8_0: 0.18×; a 1024² Q4_0 base and a
      rank-8 update, gguf's quantizers), so a 4-bit merge rounds most of the training away.
      Q8_0 keeps it at ~2× a Q4 base's size; the adapter written beside it (exact, for
      ``--lora`` over the untouched base) is the base's size plus megabytes.
    Rows that are not whole Q8_0 blocks get ``f16`` instead of a per-tensor fallback.
    """
    if base_types is None:
        return "f32"
    kinds = set(base_types)
    if len(kinds) == 1 and next(iter(kinds)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(kinds))]
    if not kinds or any(length % _BLOCK for length in row_lengths):
        return "f16"
    return "q8_0"

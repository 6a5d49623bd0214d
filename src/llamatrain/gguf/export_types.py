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

from gguf import GGMLQuantizationType, LlamaFileType

from llamatrain.errors import ConfigError

__all__ = [
    "ALL_EXPORT_TYPES",
    "EXPORT_TYPES",
    "FILE_TYPES",
    "QUANTIZER_TYPES",
    "check_export_type",
    "general_file_type",
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

"""Special tokens in text: which tokens llama.cpp cuts out of text, and how.

Before running a vocabulary's algorithm, llama.cpp's ``tokenizer_st_partition`` cuts the text
at every occurrence of certain tokens, longest first, and emits those tokens' ids directly:
user-defined tokens always, control and unknown tokens only when the caller asks it to parse
special tokens (``parse_special``; our ``special=True``). Without that, ``"<|eot_id|>"`` typed by
a user is tokenized as ordinary text and can never forge a control token.

llama.cpp also *retypes* some tokens by their text: a token that looks like an end-of-turn,
end-of-generation or fill-in-the-middle marker becomes a control token even when the file says
it is normal or user-defined (a converter bug it works around). That changes which tokens are
cut out and what decoding renders, so the same retyping is applied here. And for a model whose
``general.name`` says Phi-3, llama.cpp drops the whitespace after most special tokens in the
text (their RSTRIP attribute, :func:`rstrip_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from llamatrain.tokenizer.base import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
)

__all__ = [
    "CONTROL_LOOKING",
    "EOT_TEXTS",
    "effective_types",
    "find_eot",
    "rstrip_ids",
    "split_on_tokens",
    "split_order",
]

EOT_TEXTS: tuple[str, ...] = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
"""Texts llama.cpp takes for the end-of-turn token when the file names none, in our order of
preference (llama.cpp takes whichever its hash map yields first)."""

CONTROL_LOOKING: frozenset[str] = frozenset(
    {
        *EOT_TEXTS,
        # end of generation
        "<|eom_id|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "</s>", "[EOT]",
        "[EOS]", "<eos>", "<turn|>", "<|tool_response>", "[e~[",
        # fill in the middle
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
        "▁<PRE>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
        "▁<SUF>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
        "▁<MID>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
        "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    }
)  # fmt: skip
"""Token texts llama.cpp treats as control tokens whatever type the file gives them."""


_C_SPACE = " \t\n\v\f\r"  # what C's isspace() accepts


def effective_types(pieces: Sequence[str], types: Sequence[int]) -> list[int]:
    """The token types llama.cpp tokenizes and decodes with: the file's, with control-looking
    tokens (:data:`CONTROL_LOOKING`) retyped as control."""
    return [
        TOKEN_TYPE_CONTROL if piece in CONTROL_LOOKING else int(t)
        for piece, t in zip(pieces, types, strict=True)
    ]


def find_eot(pieces: Sequence[str]) -> int | None:
    """The end-of-turn id llama.cpp detects by text when the file names none, or None."""
    index = {p: i for i, p in enumerate(pieces) if p in EOT_TEXTS}
    return next((index[t] for t in EOT_TEXTS if t in index), None)


def split_order(pieces: Sequence[str], types: Sequence[int], *, special: bool) -> list[int]:
    """Ids of the tokens cut out of text, in llama.cpp's order: longest (UTF-8 bytes) first.

    User-defined tokens always; control and unknown ones only when ``special`` (llama.cpp's
    ``parse_special``). ``types`` are :func:`effective_types`. Ties keep id order.
    """
    kinds = {TOKEN_TYPE_USER_DEFINED}
    if special:
        kinds |= {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN}
    ids = [i for i, t in enumerate(types) if t in kinds]
    return sorted(ids, key=lambda i: -len(pieces[i].encode("utf-8")))


def rstrip_ids(
    model_name: str | None, pieces: Sequence[str], types: Sequence[int]
) -> frozenset[int]:
    """The tokens after which llama.cpp drops the whitespace that follows them in the text.

    llama.cpp gives its RSTRIP attribute by the model's ``general.name``: for a name containing
    "phi-3" or "phi3" (any case) every token it cuts out of text (control, user-defined and
    unknown, after :func:`effective_types`; ``types`` are the file's) and ``</s>``, except
    ``<unk>``, ``<s>`` and ``<|endoftext|>``. No other llama or gpt2 vocabulary has the attribute.
    """
    name = (model_name or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return frozenset()
    cut_out = {TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN}
    ids = {i for i, t in enumerate(effective_types(pieces, types)) if t in cut_out}
    named = {p: i for i, p in enumerate(pieces) if p in ("</s>", "<unk>", "<s>", "<|endoftext|>")}
    if "</s>" in named:
        ids.add(named["</s>"])
    ids.difference_update(named[p] for p in ("<unk>", "<s>", "<|endoftext|>") if p in named)
    return frozenset(ids)


def split_on_tokens(
    text: str, order: Sequence[int], pieces: Sequence[str], rstrip: Set[int] = frozenset()
) -> list[str | int]:
    """``text`` cut at every occurrence of the tokens in ``order`` (each token in turn, over
    the fragments still text): token ids, and the non-empty text between them. The text after
    a token in ``rstrip`` loses its leading whitespace (C's ``isspace``), as in llama.cpp."""
    if not text:
        return []
    fragments: list[str | int] = [text]
    for tid in order:
        piece = pieces[tid]
        if not any(isinstance(f, str) and piece in f for f in fragments):
            continue
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or piece not in fragment:
                split.append(fragment)
                continue
            for j, part in enumerate(fragment.split(piece)):
                if j:
                    split.append(tid)
                    if tid in rstrip:
                        part = part.lstrip(_C_SPACE)
                if part:
                    split.append(part)
        fragments = split
    return fragments

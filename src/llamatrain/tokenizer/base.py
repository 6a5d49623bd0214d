"""What llamatrain needs of a tokenizer, and the token types llama.cpp gives vocabulary entries.

The trainer, the data pipeline, checkpoints and text generation only ever call the methods of
:class:`Tokenizer`, so a vocabulary of either family (SPM or byte-level BPE) plugs in by
providing them; nothing outside this package and the GGUF layer needs to know which it holds.
Both families implement it on :class:`~llamatrain.tokenizer.vocab.VocabTokenizer`, which holds
what they do alike; the protocol stays the type, so a test double needs no base class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "TOKEN_TYPE_BYTE",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_NAMES",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_USER_DEFINED",
    "Tokenizer",
]

# llama.cpp's llama_token_type, stored per token in GGUF files; sentencepiece numbers its piece
# types the same way, so a sentencepiece model's types carry over unchanged.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

TOKEN_TYPE_NAMES: dict[int, str] = {
    TOKEN_TYPE_NORMAL: "normal",
    TOKEN_TYPE_UNKNOWN: "unknown",
    TOKEN_TYPE_CONTROL: "control",
    TOKEN_TYPE_USER_DEFINED: "user-defined",
    TOKEN_TYPE_UNUSED: "unused",
    TOKEN_TYPE_BYTE: "byte",
}
"""Human-readable token type names, as vocabulary summaries print them."""


@runtime_checkable
class Tokenizer(Protocol):
    """A vocabulary that turns text into the ids a model is trained on, and back.

    Ids must be the ones llama.cpp produces for the exported GGUF: a model trained on other ids
    sees different ones at inference time.
    """

    @property
    def vocab_size(self) -> int:
        """Number of ids; the model's embedding has this many rows."""
        ...

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id, put before every document."""
        ...

    @property
    def eos_id(self) -> int:
        """End-of-sequence id; generation stops on it."""
        ...

    @property
    def unk_id(self) -> int | None:
        """The id text falls back to when the vocabulary cannot spell it; None when nothing
        can be unknown (byte-level BPE has a token for every byte)."""
        ...

    @property
    def pad_id(self) -> int | None:
        """The padding id, or None when the vocabulary has none (llama's usually has not)."""
        ...

    @property
    def add_bos(self) -> bool:
        """Whether llama.cpp puts BOS before a prompt it tokenizes with special tokens."""
        ...

    @property
    def add_eos(self) -> bool:
        """Whether llama.cpp puts EOS after a prompt it tokenizes with special tokens."""
        ...

    def encode(
        self, text: str, bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[int]:
        """Ids for ``text``, exactly as llama.cpp tokenizes it; optionally framed by BOS/EOS.

        ``special`` is llama.cpp's ``parse_special``: control tokens written in the text (a
        chat template's ``<|im_start|>``) become their ids. Off, they are tokenized as text,
        so user text can never forge one.
        """
        ...

    def encode_prompt(self, text: str, special: bool = True) -> list[int]:
        """Ids for ``text`` as llama.cpp tokenizes text it runs a model on (``llama_tokenize``
        with ``add_special``): BOS first if :attr:`add_bos`, EOS last if :attr:`add_eos`, as the
        model file says. The one way to encode a prompt or a text to score: a file such as
        Qwen2.5 Instruct's says no BOS, and a BOS it was not trained with changes the output.

        ``special`` defaults on, as llama-completion and llama-cpp-python parse the control
        tokens a prompt writes; ``llama-perplexity`` tokenizes its text with it off.
        """
        ...

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[list[int]]:
        """:meth:`encode` for many strings at once, which an implementation may parallelise."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """What llama.cpp renders for one token, so generated text can be streamed."""
        ...

    def fingerprint(self) -> str:
        """A hash of everything that decides ids: equal fingerprints mean equal tokenization.

        Checkpoints and token caches store it to refuse a different vocabulary.
        """
        ...

    def newline_ids(self) -> list[int]:
        """Ids whose text ends in a newline, where training windows may start."""
        ...

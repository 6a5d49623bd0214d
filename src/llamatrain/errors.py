"""User-facing errors.

Anything a user can fix (a bad config key, a missing file, a corrupt GGUF, a NaN loss) is
raised as a ``LlamatrainError`` subclass with one message that names the problem and the
fix. The CLI prints that message and exits non-zero without a traceback (``--debug`` shows
it); anything else is a bug and keeps its traceback.
"""


def shown(text: str, limit: int | None = 80) -> str:
    """Text a file or a flag supplied (a key, a tensor name, a value), as a message or report
    shows it: every character that is not printable escaped as Python writes it (``\\n``,
    ``\\x1b``, ``\\ud800``), so it can neither break a one-line message nor forge lines of a
    report; cut to ``limit`` characters, marked ``...`` (a name may be 100 kB; None: whole)."""
    head = text if limit is None else text[: limit + 1]
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in head)
    return out if limit is None or len(out) <= limit else out[: limit - 3] + "..."


class LlamatrainError(Exception):
    """Base class: a problem the user can act on.

    Its text is :func:`shown` whole: a message quotes files, data and what a model's chat
    template says, and none of it may reach a terminal as escape sequences or break the one
    line, wherever the message is printed (the CLI, a traceback, a notebook)."""

    def __str__(self) -> str:
        return shown(super().__str__(), None)


class LlamatrainWarning(UserWarning):
    """What a run tells its user without stopping (skipped lines, a rebuilt cache, rows read in
    one of two layouts). Its text is :func:`shown` whole, as an error's is: a warning quotes
    file names, data and what a model's chat template says, and the Python API's warnings
    reach a terminal or a notebook without passing through the CLI's formatting."""

    def __str__(self) -> str:
        return shown(super().__str__(), None)


class ConfigError(LlamatrainError, ValueError):
    """A config file, an override or a ModelConfig is invalid."""


class DataError(LlamatrainError):
    """Input text is missing, empty, binary or too short."""


class TokenizerError(LlamatrainError):
    """A vocabulary or tokenizer file is unusable."""


class GGUFError(LlamatrainError):
    """A GGUF file is unreadable, corrupt or of an unsupported kind."""


class CheckpointError(LlamatrainError):
    """A checkpoint is missing or does not match the run."""


class TrainingError(LlamatrainError):
    """Training cannot go on (e.g. the loss became NaN)."""


class RunInUseError(LlamatrainError):
    """Another process is training into the same run folder."""


class ModelError(LlamatrainError):
    """A model cannot be used as it is: its weights hold NaN or infinite values."""


class OutputError(LlamatrainError):
    """An output path is not llamatrain's to write: a link, a pipe, a device, a folder, a file
    of another kind, or a run folder that holds a run."""


class MemoryBudgetError(LlamatrainError):
    """A run needs more memory than the machine can give it."""

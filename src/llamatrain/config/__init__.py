"""Run configuration: one dataclass per TOML section, ``--set`` overrides, validation.

A run is fully described by a TOML file with the sections ``[model]``, ``[tokenizer]``,
``[data]``, ``[optim]``, ``[train]``, ``[output]`` and ``[lora]``; every key is optional and
falls back to the dataclass default. ``--set section.key=value`` overrides are applied on top,
then the whole config is validated once, so a file that is only valid *after* its overrides
still works.

Why dataclasses driven by type hints: one generic checker (``fields.check_type``) covers every
field, the help text lives next to the default (``field(metadata={"help": ...})``) and the
docs' config reference (docs/reference/config.md) is generated from the same place
(:func:`config_reference`), so the three never drift apart. Per-field value rules
(``choices``, ``gt``, ``ge``, ``lt``, ``le``) are metadata too; only rules that tie several
fields together are written out in :func:`validate`.

Every problem is a :class:`~llamatrain.errors.ConfigError` whose message names the key, where
its value came from (file or ``--set``) and what would be accepted.

The package: ``sections`` (the dataclasses), ``fields`` (typing one value), ``build`` (files,
``--set`` items, keywords, TOML out) and ``validate`` (the cross-field rules).
"""

from llamatrain.config.build import (
    BUILTIN_CONFIGS,
    apply_overrides,
    apply_values,
    builtin_config_names,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    load_config,
    read_config,
)
from llamatrain.config.sections import (
    SECTIONS,
    Config,
    DataSection,
    LoraSection,
    OptimSection,
    OutputSection,
    TokenizerSection,
    TrainSection,
    config_reference,
)
from llamatrain.config.validate import check_sampler, sample_params, set_in, validate

__all__ = [
    "BUILTIN_CONFIGS",
    "SECTIONS",
    "Config",
    "DataSection",
    "LoraSection",
    "OptimSection",
    "OutputSection",
    "TokenizerSection",
    "TrainSection",
    "apply_overrides",
    "apply_values",
    "builtin_config_names",
    "check_sampler",
    "config_from_dict",
    "config_reference",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "read_config",
    "sample_params",
    "set_in",
    "validate",
]

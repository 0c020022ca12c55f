"""Which model a command works on: a checkpoint, a named size + encoding, or the default (the
zoo's trained model for the encoding). Above the zoo's registry, so ``deploykit.nn`` knows nothing
of the zoo."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from deploykit.encodings import encoding_name, get_config
from deploykit.errors import CheckpointError
from deploykit.nn.checkpoint import (
    CONFIG_FILE,
    DEFAULT_ENCODING,
    DEFAULT_MODEL,
    WEIGHTS_FILE,
    default_model,
    load_model,
    options_applied,
    with_encoding_options,
)
from deploykit.nn.factory import Model, create_model
from deploykit.zoo.registry import ZOO, model_dir, zoo_dir


def resolve_model(
    checkpoint: Path | None = None, encoding: str | None = None, model_name: str | None = None, options: Sequence[str] = ()
) -> tuple[Model, str]:
    """Pick the model for a command.

    * a checkpoint directory or a weights file with ``config.json`` beside it: loaded as is
      (``--encoding``/``--model`` must then agree with it or be omitted);
    * a bare weights file: architecture from ``model_name`` + ``encoding`` (defaults as below);
    * no checkpoint and no ``model_name``: the trained zoo model for ``encoding`` (default
      ``ape``: ``models/shapes-ape``), refused when there is none (a wheel does not ship
      ``models/``): nobody should get an untrained model believing it is the zoo's;
    * ``model_name`` without a checkpoint: the seeded untrained ``model_name`` + ``encoding``.

    ``options`` (``key=value``, the command line's ``--set``) then change the chosen model's
    encoding options, typed and checked against its config (``deploykit.encodings.parse_options``).

    Returns:
        The model (eval mode) and a string describing where it came from.

    Raises:
        ConfigError: an unknown encoding or model name.
        CheckpointError: no trained zoo model where one was needed; a bad checkpoint.
    """
    if checkpoint is None and model_name is None:
        wanted = encoding or DEFAULT_ENCODING
        get_config(wanted)  # an unknown encoding is named as such, with the choices
        if zoo := trained_zoo_model(wanted):
            return with_encoding_options(load_model(zoo), options, f"zoo:{zoo.name}"), f"zoo:{zoo.name}"
        raise CheckpointError(
            f"no trained zoo model for encoding {wanted} in {zoo_dir()} (a wheel does not ship models/); pass "
            f"--checkpoint DIR, or --model NAME (e.g. {DEFAULT_MODEL}) for a seeded untrained model"
        )
    if checkpoint is None:
        model = default_model(encoding=encoding, model=model_name)
        if options:  # untrained: the options shape the seeded model itself (ape=true adds a table)
            model = default_model(encoding=options_applied(model.cfg.encoding, options), model=model_name)
        return model, f"default:{model_name}+{encoding_name(model.cfg.encoding)}"
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise CheckpointError(f"checkpoint not found: {checkpoint}")
    config_dir = checkpoint if checkpoint.is_dir() else checkpoint.parent
    if (config_dir / CONFIG_FILE).is_file():
        model = load_model(checkpoint)
        if encoding and encoding != encoding_name(model.cfg.encoding):
            raise CheckpointError(
                f"--encoding {encoding} disagrees with {config_dir / CONFIG_FILE} ({encoding_name(model.cfg.encoding)}); drop --encoding"
            )
        return with_encoding_options(model, options, str(checkpoint)), str(checkpoint)
    if checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} has no {CONFIG_FILE}; pass a weights file with --model/--encoding")
    model = create_model(model_name or DEFAULT_MODEL, encoding=encoding)
    config = dataclasses.replace(model.cfg, encoding=options_applied(model.cfg.encoding, options))
    return load_model(checkpoint, config=config), str(checkpoint)


def trained_zoo_model(encoding: str) -> Path | None:
    """The directory of the trained zoo model for ``encoding`` (its first zoo entry), if any."""
    for name, entry in ZOO.items():
        if entry.encoding == encoding and (model_dir(name) / WEIGHTS_FILE).is_file():
            return model_dir(name)
    return None

"""Which model a command works on: a checkpoint, a named size + encoding, or the default."""

from __future__ import annotations

from pathlib import Path

from deploykit.encodings import encoding_name
from deploykit.errors import CheckpointError
from deploykit.nn.checkpoint import CONFIG_FILE, DEFAULT_ENCODING, DEFAULT_MODEL, WEIGHTS_FILE, default_model, load_model
from deploykit.nn.factory import Model, create_model


def resolve_model(
    checkpoint: Path | None = None, encoding: str | None = None, model_name: str | None = None
) -> tuple[Model, str]:
    """Pick the model for a command.

    * a checkpoint directory or a weights file with ``config.json`` beside it: loaded as is
      (``--encoding``/``--model`` must then agree with it or be omitted);
    * a bare weights file: architecture from ``model_name`` + ``encoding`` (defaults as below);
    * no checkpoint and no ``model_name``: the trained zoo model for ``encoding`` (default
      ``ape``: ``models/shapes-ape``) when the zoo has one;
    * otherwise the seeded untrained ``model_name`` (default ``vit_tiny_patch16``) + ``encoding``.

    Returns:
        The model (eval mode) and a string describing where it came from.
    """
    if checkpoint is None and model_name is None and (zoo := trained_zoo_model(encoding or DEFAULT_ENCODING)):
        return load_model(zoo), f"zoo:{zoo.name}"
    if checkpoint is None:
        name = model_name or DEFAULT_MODEL
        model = default_model(encoding=encoding, model=name)
        return model, f"default:{name}+{encoding_name(model.cfg.encoding)}"
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
        return model, str(checkpoint)
    if checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} has no {CONFIG_FILE}; pass a weights file with --model/--encoding")
    model = create_model(model_name or DEFAULT_MODEL, encoding=encoding)
    return load_model(checkpoint, config=model.cfg), str(checkpoint)


def trained_zoo_model(encoding: str) -> Path | None:
    """The directory of the trained zoo model for ``encoding`` (its first zoo entry), if any."""
    from deploykit.zoo.registry import ZOO, model_dir

    for name, entry in ZOO.items():
        if entry.encoding == encoding and (model_dir(name) / WEIGHTS_FILE).is_file():
            return model_dir(name)
    return None

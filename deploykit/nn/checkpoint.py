"""Loading and saving models: ``config.json`` + ``model.safetensors``, and the embedded default.

A ``.pt``/``.pth`` checkpoint is read only with ``torch.load(weights_only=True)``, which refuses
pickled code. Every failure is a one-line ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from deploykit._fields import json_nesting
from deploykit._io import atomic_path, write_json_atomic
from deploykit.encodings import EncodingConfig, config_to_dict, parse_options
from deploykit.encodings import config_from_dict as encoding_from_dict
from deploykit.errors import CheckpointError, ConfigError, one_line
from deploykit.nn.factory import Model, ModelConfig, build_model, config_from_dict, create_model

CONFIG_FILE = "config.json"
# config.json holds objects in an object (the encoding) holding lists (mean, std): 3 levels; the
# margin is for what later versions may add.
MAX_CONFIG_NESTING = 8
WEIGHTS_FILE = "model.safetensors"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")

# The untrained fallback for a named size or an encoding the zoo has no trained model for
# (the embedded default is the zoo's models/shapes-ape, see deploykit.zoo.resolve): ViT-Tiny/16 +
# learned APE, weights drawn from a fixed seed, so `deploykit export` works with no checkpoint.
DEFAULT_MODEL = "vit_tiny_patch16"
DEFAULT_ENCODING = "ape"
DEFAULT_SEED = 0


def default_model(encoding: str | EncodingConfig | None = DEFAULT_ENCODING, model: str = DEFAULT_MODEL) -> Model:
    """The embedded default model (deterministic weights from ``DEFAULT_SEED``); ``encoding`` (a
    registry name or a config) None means the architecture's own default."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(DEFAULT_SEED)
        return create_model(model, encoding=encoding).eval()
    finally:
        torch.random.set_rng_state(generator_state)


# Where training scripts put the trained weights in the file they save, in the order they are
# looked for: timm/DeiT (``model``, ``state_dict``), the MoPE repository (``model_state``), the
# PyTorch tutorials' ``model_state_dict``.
WEIGHTS_KEYS = ("model", "state_dict", "model_state", "model_state_dict")
# The EMA copy beside them (DeiT's ``model_ema``, timm's ``state_dict_ema``): taken only when asked.
EMA_KEYS = ("model_ema", "state_dict_ema")


def _harmless_globals() -> list:
    """What training scripts store beside their weights and ``torch.load(weights_only=True)``
    refuses although it runs nothing: the script's ``argparse.Namespace`` (DeiT, timm), paths,
    numpy scalars (a best accuracy). Allowed by name for one load; any other global is refused."""
    import argparse
    import pathlib

    import numpy as np

    try:  # numpy 2 (numpy 1 names it numpy.core.multiarray)
        from numpy._core.multiarray import scalar
    except ImportError:
        from numpy.core.multiarray import scalar

    allowed = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, np.dtype, scalar]
    allowed += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    return allowed


@dataclass(frozen=True)
class TrainingCheckpoint:
    """A file a training script wrote, read without running anything in it.

    Attributes:
        path: the file.
        weights: the trained model's state dict (DDP's ``module.`` and torch.compile's ``_orig_mod.``
            prefixes removed).
        container: the key the weights were under (``model``, ``model_state``, ...); None when the
            file is the state dict itself.
        ema: the EMA copy's state dict, when the file holds one.
        extras: everything else the file holds (``args`` as a dict, ``epoch``, ``step``, ...).
    """

    path: Path
    weights: dict[str, Tensor]
    container: str | None = None
    ema: dict[str, Tensor] | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def chosen(self, ema: bool = False) -> dict[str, Tensor]:
        """The trained weights, or (``ema``) the EMA copy; refused in one line when there is none."""
        if not ema:
            return self.weights
        if self.ema is None:
            raise CheckpointError(f"{self.path} holds no EMA weights (looked for {', '.join(EMA_KEYS)}); drop --ema")
        return self.ema

    @property
    def args(self) -> dict[str, Any]:
        """The training script's arguments (an ``argparse.Namespace`` saved as ``args``), or {}."""
        args = self.extras.get("args")
        return vars(args) if hasattr(args, "__dict__") else dict(args) if isinstance(args, dict) else {}


@dataclass(frozen=True)
class Imported:
    """An imported model and what was read from the file or assumed.

    Attributes:
        model: the deploykit model; its forward is the official forward.
        source: ``"<importer>:<file>"`` (saved in the weights' metadata).
        read: what the file said (``{"depth": 12, "heads": 6, ...}``).
        assumed: what the file does not hold and the import took: the importer's ``Assumption``
            values (``deploykit.importers``), or the training script's defaults.
    """

    model: Model
    source: str
    read: dict[str, Any] = dataclasses.field(default_factory=dict)
    assumed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def with_model(self, model: Model) -> Imported:
        return dataclasses.replace(self, model=model)

    def describe(self) -> str:
        """One line: what was read and what was assumed."""
        read = ", ".join(f"{k} {v}" for k, v in self.read.items())
        assumed = ", ".join(f"{k}={v}" for k, v in self.assumed.items())
        return read + (f"; not in the file, assumed: {assumed}" if assumed else "")


def load_checkpoint(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a state dict from ``.safetensors`` or (weights only) ``.pt``/``.pth``/``.bin``: a bare
    state dict, or the trained weights of a training script's file (``read_training_checkpoint``).

    Raises:
        CheckpointError: missing, unreadable, corrupt, or of an unknown format.
    """
    return read_training_checkpoint(path).weights


def read_training_checkpoint(path: str | os.PathLike) -> TrainingCheckpoint:
    """Read the weights, the EMA copy and the rest of a checkpoint file (``.safetensors``: weights only).

    Raises:
        CheckpointError: missing, unreadable, corrupt, of an unknown format, a pickle that would
            run code, or no state dict of tensors where the weights should be.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return TrainingCheckpoint(path, load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"corrupt safetensors checkpoint {path}: {err}") from err
    if path.suffix in _TORCH_SUFFIXES:
        return _torch_training_checkpoint(path)
    raise CheckpointError(f"unsupported checkpoint format {path.suffix!r} for {path}; expected .safetensors or .pt")


def _torch_training_checkpoint(path: Path) -> TrainingCheckpoint:
    try:
        with torch.serialization.safe_globals(_harmless_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types (UnpicklingError, RuntimeError, EOFError...)
        raise CheckpointError(f"cannot load {path} with weights_only=True: {_torch_load_reason(err)}") from err
    if _is_state_dict(obj):
        return TrainingCheckpoint(path, _without_wrapper_prefixes(obj))
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} does not hold a state dict of tensors: it holds a {type(obj).__name__}")
    container = next((key for key in WEIGHTS_KEYS if _is_state_dict(obj.get(key))), None)
    if container is None:
        keys = ", ".join(map(str, list(obj)[:6])) + (", ..." if len(obj) > 6 else "")
        raise CheckpointError(
            f"{path} does not hold a state dict of tensors: its top-level keys are {keys}; "
            f"expected tensors, or the weights under one of {', '.join(WEIGHTS_KEYS)}"
        )
    ema_key = next((key for key in EMA_KEYS if _is_state_dict(obj.get(key))), None)
    extras = {k: v for k, v in obj.items() if k not in (container, ema_key)}
    ema = _without_wrapper_prefixes(obj[ema_key]) if ema_key else None
    return TrainingCheckpoint(path, _without_wrapper_prefixes(obj[container]), container, ema, extras)


def _is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())


def _without_wrapper_prefixes(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A model saved from inside ``DistributedDataParallel`` names every tensor ``module.*``, one
    saved after ``torch.compile`` ``_orig_mod.*`` (either or both, in that order)."""
    for prefix in ("module.", "_orig_mod."):
        if all(k.startswith(prefix) for k in state):
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def _torch_load_reason(err: Exception) -> str:
    """The informative part of a ``torch.load`` error: for a refused pickle, which global it
    refused, without torch's advice (to allowlist the global, or to load with ``weights_only=False``:
    both would run the file's code)."""
    text = str(err)
    refused = re.search(r"Unsupported global: GLOBAL (\S+) was not an allowed global", text)
    if refused:
        return f"Unsupported global: {refused.group(1)} (loading it would run code the file names; deploykit never does)"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    unpickler = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    return (unpickler or lines or [type(err).__name__])[0]


def load_weights(model: Model, state_dict: dict[str, Tensor], source: str | os.PathLike, assign: bool = False) -> None:
    """Load a (timm-named) state dict strictly, raising one line that lists what does not fit
    (``assign``: take the tensors themselves rather than copying into the model's)."""
    try:
        result = model.load_state_dict(state_dict, strict=False, assign=assign)
    except RuntimeError as err:  # shape mismatches
        detail = " ".join(line.strip() for line in str(err).splitlines()[1:3])
        raise CheckpointError(f"checkpoint {source} does not fit the model: {detail}") from err
    problems = []
    if result.missing_keys:
        problems.append(f"missing {_preview(result.missing_keys)}")
    if result.unexpected_keys:
        problems.append(f"unexpected {_preview(result.unexpected_keys)}")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not fit the model: {'; '.join(problems)}")


def _preview(keys: list[str], limit: int = 4) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read a ``config.json`` written by ``save_model``: every value checked before anything is
    built from it (``ViTConfig``/``SequenceConfig``, ``deploykit._fields``).

    Raises:
        CheckpointError: missing, unreadable, not JSON, nested too deeply, or a value refused (named).
    """
    path = Path(path)
    try:
        text = path.read_text()
        depth, field = json_nesting(text)
        if depth > MAX_CONFIG_NESTING:  # before the JSON reader, which recurses once per level
            where = f"{field} nests" if field is not None else "it nests"
            raise CheckpointError(
                f"invalid model config {path}: {where} {depth:,} levels deep; a model config nests {MAX_CONFIG_NESTING} at most"
            )
        data = json.loads(text)
    except FileNotFoundError as err:
        raise CheckpointError(f"model config not found: {path}") from err
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"invalid model config {path}: {one_line(err, 200)}") from err
    try:
        return config_from_dict(data)
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"invalid model config {path}: {one_line(err)}") from err


def load_model(path: str | os.PathLike, config: ModelConfig | None = None) -> Model:
    """Load a model directory (``config.json`` + ``model.safetensors``) or a weights file.

    Args:
        path: a directory written by ``save_model``, or a weights file; for a file, the config
            is ``config`` if given, else the ``config.json`` beside it.
        config: architecture to build when ``path`` is a bare weights file.

    Raises:
        CheckpointError: missing/corrupt files or weights that do not fit.
    """
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if config is None:
        config = read_config((path if path.is_dir() else path.parent) / CONFIG_FILE)
    state_dict = load_checkpoint(weights)
    try:
        check_config_fits(config, state_dict, weights)
        model = build_model(config)
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"cannot build the model described for {path}: {err}") from err
    load_weights(model, state_dict, weights)
    return model.eval()


def check_config_fits(config: ModelConfig, state_dict: dict[str, Tensor], source: str | os.PathLike) -> None:
    """Refuse a config whose model the weights cannot fill, before allocating it: a config with
    huge sizes must fail in one line, not in the allocator.

    The model is built on the meta device (shapes only, no memory) and the weights are matched
    against it by name and shape. Building takes time in the number of blocks, so first a
    bound that needs no model: every block holds at least four weight matrices (qkv, proj and
    the MLP's two), so ``4·depth`` tensors at least.

    Raises:
        CheckpointError: the config describes more blocks than the weights hold, or other names
            or shapes.
    """
    if 4 * config.depth > len(state_dict):
        raise CheckpointError(
            f"the config describes {config.depth:,} blocks but {source} holds {len(state_dict):,} tensors (each block has "
            "at least 4 weight matrices): the config does not describe these weights"
        )
    with torch.device("meta"):
        shell = build_model(config)
    load_weights(shell, state_dict, source, assign=True)  # assign: no copy into meta tensors


def save_model(model: Model, directory: str | os.PathLike, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (timm names) into ``directory`` atomically."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={k: str(v) for k, v in (metadata or {}).items()})
    write_json_atomic(directory / CONFIG_FILE, model.cfg.to_dict())
    return directory


def with_encoding_options(model: Model, options: Sequence[str], source: str) -> Model:
    """The same weights in a model whose encoding config has ``options`` (``key=value``) applied
    (the model itself when there are none).

    Raises:
        ConfigError: an option the encoding does not have, or a value it refuses.
        CheckpointError: an option that changes the parameters (e.g. ``ape=true``), so the
            weights no longer fit.
    """
    if not options:
        return model
    changed = build_model(dataclasses.replace(model.cfg, encoding=options_applied(model.cfg.encoding, options)))
    load_weights(changed, model.state_dict(), f"{source} with --set {' '.join(options)}")
    return changed.eval()


def options_applied(config: EncodingConfig, options: Sequence[str]) -> EncodingConfig:
    """``config`` with ``key=value`` options applied, typed and checked (``parse_options``)."""
    current = config_to_dict(config)
    return encoding_from_dict({**current, **parse_options(current["name"], options)})

"""Loading and saving models: ``config.json`` + ``model.safetensors``, and the embedded default.

A ``.pt``/``.pth`` checkpoint is read only with ``torch.load(weights_only=True)``, which refuses
pickled code. Every failure is a one-line ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
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
# Hugging Face's sharded weights: this index maps every tensor name to a shard file beside it.
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
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

    allowed = [argparse.Namespace, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, np.dtype]
    allowed += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    # A pickled numpy scalar names numpy's reconstructor under its module of the numpy that wrote it.
    allowed += [(_numeric_scalar, f"{module}.multiarray.scalar") for module in ("numpy.core", "numpy._core")]
    return allowed


# The widest numpy number a training script stores beside its weights (a best accuracy, a seed).
_MAX_SCALAR_BYTES = 16


def _numeric_scalar(dtype, *data):
    """numpy's scalar reconstructor (how a pickled ``np.float64`` comes back), for numbers only:
    given a flexible dtype and no data (``V1000000000``), numpy allocates the dtype's whole size,
    and an object dtype makes an object of whatever the file holds. Refused inside ``torch.load``,
    which reports the message as the reason the file cannot be loaded."""
    import numpy as np

    try:  # numpy 2 (numpy 1 names it numpy.core.multiarray)
        from numpy._core.multiarray import scalar
    except ImportError:
        from numpy.core.multiarray import scalar

    if not isinstance(dtype, np.dtype) or dtype.kind not in "biuf" or dtype.itemsize > _MAX_SCALAR_BYTES:
        shown = str(dtype)[:40] if isinstance(dtype, np.dtype) else type(dtype).__name__
        raise CheckpointError(
            f"a numpy scalar of dtype {shown}: deploykit reads numbers of at most {_MAX_SCALAR_BYTES} bytes beside the weights, "
            "nothing of a flexible or object dtype"
        )
    return scalar(dtype, *data)


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
            values (``deploykit.cli.importers``), or the training script's defaults.
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
        if path.exists():  # a FIFO would block the reader, /dev/zero never end it
            raise CheckpointError(f"checkpoint {path} is {_file_kind(path)}, not a regular file; give the weights file itself")
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            weights = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"corrupt safetensors checkpoint {path}: {err}") from err
        return TrainingCheckpoint(path, _stored(weights, path))
    if path.suffix in _TORCH_SUFFIXES:
        return _torch_training_checkpoint(path)
    raise CheckpointError(f"unsupported checkpoint format {path.suffix!r} for {path}; expected .safetensors or .pt")


def load_sharded_checkpoint(index: str | os.PathLike) -> dict[str, Tensor]:
    """The state dict of safetensors shards listed by a ``model.safetensors.index.json``
    (``save_pretrained(max_shard_size=...)``): its ``weight_map`` names each tensor's shard.

    Each shard is a plain ``.safetensors`` file name beside the index (no path leads elsewhere),
    read once, and must hold exactly the tensors the index gives it.

    Raises:
        CheckpointError: an unreadable index, a shard name that is not a file beside it, a
            missing shard, or a tensor the index and the shards disagree on (named).
    """
    index = Path(index)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError) as err:
        raise CheckpointError(f"cannot read {index}: {one_line(err, 200)}") from err
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise CheckpointError(f"{index} has no weight_map of tensor names to shard files")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, set()).add(name)
    for shard in shards:  # every name checked before any shard is read
        if Path(shard).name != shard or shard in (".", "..") or not shard.endswith(".safetensors"):
            raise CheckpointError(f"{index} names shard {shard[:80]!r}; a shard is a .safetensors file name beside the index")
        if not (index.parent / shard).is_file():
            raise CheckpointError(f"{index} lists shard {shard!r}, which is not a file in {index.parent}")
    state: dict[str, Tensor] = {}
    for shard, names in shards.items():
        tensors = load_checkpoint(index.parent / shard)
        stray, missing = sorted(set(tensors) - names), sorted(names - set(tensors))
        if stray or missing:
            which = (
                f"{stray[0]} is in it but the index puts it elsewhere" if stray else f"it lacks {missing[0]}, which the index puts there"
            )
            raise CheckpointError(f"shard {index.parent / shard} does not match {index.name}: {which}")
        state.update(tensors)
    return state


def _file_kind(path: Path) -> str:
    import stat

    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a special file")


def _torch_training_checkpoint(path: Path) -> TrainingCheckpoint:
    try:
        with torch.serialization.safe_globals(_harmless_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types (UnpicklingError, RuntimeError, EOFError...)
        raise CheckpointError(f"cannot load {path} with weights_only=True: {_torch_load_reason(err)}") from err
    if _is_state_dict(obj):
        return TrainingCheckpoint(path, _stored(_without_wrapper_prefixes(obj), path))
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
    ema = _stored(_without_wrapper_prefixes(obj[ema_key]), path, ema_key) if ema_key else None
    return TrainingCheckpoint(path, _stored(_without_wrapper_prefixes(obj[container]), path, container), container, ema, extras)


def _stored(state: dict[str, Tensor], path: Path, container: str | None = None) -> dict[str, Tensor]:
    """``state`` with every tensor's values held once in memory, checked before any is copied.

    A pickle may describe a tensor as a view of stored values (``weights_only`` loads it): one
    stored element seen through zero strides as a ``[46341, 46341]`` matrix, or one storage under
    ten thousand names. Whatever is read from such views (a size, a table built from it) is then
    as large as they look, not as the file is. So the bytes the tensors describe, summed over
    every name, are held to ``MAX_VIEW_RATIO`` times the file's own bytes (a tied head shares its
    embedding's storage: twice at most in real files); only then are overlapping views
    materialised, so nothing downstream writes into values another name shares. Complex tensors
    are refused by name: no model deploykit imports has complex weights, and converting them
    drops their imaginary part.

    Raises:
        CheckpointError: the described bytes exceed the bound, or a complex tensor.
    """
    where = f"{path} ({container})" if container else str(path)
    described = 0
    for key, tensor in state.items():
        if len(key) > MAX_KEY_CHARS or not key.isprintable():
            shown = repr(key[:60]) + ("..." if len(key) > 60 else "")
            raise CheckpointError(
                f"{where}: a weight is named {shown} ({len(key):,} characters); weight names are printable and at most {MAX_KEY_CHARS:,} long"
            )
        problem = _not_plain(tensor)
        if problem:
            raise CheckpointError(f"{where}: {key} is {problem}; a weight is a dense tensor of numbers in memory")
        if tensor.is_complex():
            raise CheckpointError(f"{where}: {key} holds complex values ({tensor.dtype}); a weight is real")
        described += tensor.numel() * tensor.element_size()
    limit = MAX_VIEW_RATIO * path.stat().st_size + (1 << 20)
    if described > limit:
        raise CheckpointError(
            f"{where}: its tensors describe {described:,} bytes but the file holds {path.stat().st_size:,}: views repeating stored "
            f"values (a zero stride, one storage under many names); deploykit takes at most {MAX_VIEW_RATIO}x the file's size"
        )
    return {key: tensor if _holds_its_values(tensor) else tensor.contiguous() for key, tensor in state.items()}


# What the tensors of a checkpoint may describe, as a multiple of the file's bytes (plus 1 MiB).
MAX_VIEW_RATIO = 4
# The longest weight name read (timm's longest are under 100 characters): every message names keys.
MAX_KEY_CHARS = 1024
# The dtypes a weight or buffer is stored in: the float types deploykit computes in, and the
# integers and booleans of buffers (positions, masks). Float8 and unsigned wide integers have no
# arithmetic on the CPU (``isfinite`` alone raises), quantized dtypes none outside quantized kernels.
PLAIN_DTYPES = frozenset(
    (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
    + (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
)


def _not_plain(tensor: Tensor) -> str | None:
    """What makes ``tensor`` other than a dense strided CPU tensor of a ``PLAIN_DTYPES`` dtype
    (``weights_only`` also rebuilds meta, sparse, nested and quantized tensors, whose sizes describe
    no stored values and on which the checks below raise), or None."""
    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    if tensor.device.type != "cpu":
        return f"a tensor on the {tensor.device.type} device (no values stored)"
    if tensor.dtype not in PLAIN_DTYPES:
        return f"of dtype {tensor.dtype}"
    return None


def _holds_its_values(tensor: Tensor) -> bool:
    """``tensor`` is dense: every element at its own place (no zero or overlapping strides)."""
    return tensor.is_contiguous() and tensor.numel() * tensor.element_size() <= tensor.untyped_storage().nbytes()


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
    refused = re.search(r"Unsupported global: GLOBAL (\S+) was not an allowed global|unsupported GLOBAL (\S+) whose module", text)
    if refused:
        name = refused.group(1) or refused.group(2)
        return f"Unsupported global: {name} (loading it would run code the file names; deploykit never does)"
    built = re.search(r"Can only build .* but got <class '([\w.]+)'>", text)
    if built:
        return f"it builds a {built.group(1)}, which is not a weight or a number; deploykit reads neither code nor objects"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # torch's message: its advice (to load with weights_only=False) first, then "WeightsUnpickler
    # error:" and the reason, on that line or the next, then more advice.
    marker = next((i for i, line in enumerate(lines) if "WeightsUnpickler error:" in line), None)
    if marker is not None:
        reason = lines[marker].split("WeightsUnpickler error:", 1)[1].strip()
        return reason or (lines[marker + 1] if marker + 1 < len(lines) else "refused by torch's weights-only unpickler")
    advice = re.compile(r"weights_only|safe_globals|Weights only load failed")
    return next((line for line in lines if not advice.search(line)), type(err).__name__)


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


def block_count(state: dict[str, Tensor], source: str | os.PathLike, prefix: str = "blocks") -> int:
    """How many ``prefix.N.`` blocks the keys of ``state`` hold, numbered 0..n-1 without a gap: a
    count bounded by the keys present, whatever number a key carries (``blocks.99999999.``).

    Raises:
        CheckpointError: a block number that is not a decimal integer, or a gap (the first missing
            block named).
    """
    indices = set()
    for key in state:
        head, dot, rest = key.partition(".")
        if head != prefix or not dot:
            continue
        index = rest.partition(".")[0]
        if not (index.isascii() and index.isdigit()) or len(index) > 18 or len(index) > 1 and index.startswith("0"):
            raise CheckpointError(f"checkpoint {source}: key {key[:80]!r} numbers its block {index[:20]!r}; blocks are numbered 0, 1, ...")
        indices.add(int(index))
    ordered = sorted(indices)
    gap = next((i for i, index in enumerate(ordered) if index != i), None)
    if gap is not None:
        raise CheckpointError(
            f"checkpoint {source} has no {prefix}.{gap}.* but has {prefix}.{ordered[-1]:,}.* (or later): blocks are numbered from 0 without a gap"
        )
    return len(ordered)


def shape_of(state: dict[str, Tensor], key: str, ndim: int, source: str | os.PathLike) -> tuple[int, ...]:
    """The shape of ``state[key]``, a size an importer reads: refused unless it has ``ndim``
    dimensions, none of them empty (a width of 0 describes no model).

    Raises:
        CheckpointError: missing, another rank, or an empty dimension, named with its shape.
    """
    if key not in state:
        raise CheckpointError(f"checkpoint {source} has no {key}")
    shape = tuple(state[key].shape)
    if len(shape) != ndim or 0 in shape:
        raise CheckpointError(f"checkpoint {source}: {key} has shape {list(shape)}; expected {ndim} non-empty dimensions")
    return shape


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


# Checkpoint directories in other layouts, as (recognises, loads) pairs their modules register when
# imported (``deploykit.nn``'s package imports them): a ``transformers`` ``save_pretrained``
# directory (``deploykit.nn.from_transformers``). ``load_model`` asks each before reading a
# directory as its own.
DIRECTORY_LAYOUTS: list[tuple[Callable[[Path], bool], Callable[[Path], Model]]] = []


def load_model(path: str | os.PathLike, config: ModelConfig | None = None) -> Model:
    """Load a model directory (``config.json`` + ``model.safetensors``), a Hugging Face
    ``transformers`` ``save_pretrained`` directory (``deploykit.nn.from_transformers``) or a weights file.

    Args:
        path: a directory written by ``save_model``, or a weights file; for a file, the config
            is ``config`` if given, else the ``config.json`` beside it.
        config: architecture to build when ``path`` is a bare weights file.

    Raises:
        CheckpointError: missing/corrupt files or weights that do not fit.
    """
    path = Path(path)
    if config is None and path.is_dir():
        for recognises, loads in DIRECTORY_LAYOUTS:
            if recognises(path):  # mapped (or refused) as its own import command does
                return loads(path)
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
    load_weights(_meta_model(config, state_dict, source), state_dict, source, assign=True)  # assign: no copy into meta tensors


def _meta_model(config: ModelConfig, state_dict: dict[str, Tensor], source: str | os.PathLike) -> Model:
    """``config``'s model on the meta device, once the weights hold enough tensors for its depth."""
    if 4 * config.depth > len(state_dict):
        raise CheckpointError(
            f"the config describes {config.depth:,} blocks but {source} holds {len(state_dict):,} tensors (each block has "
            "at least 4 weight matrices): the config does not describe these weights"
        )
    with torch.device("meta"):
        return build_model(config)


def imported_model(config: ModelConfig, state_dict: dict[str, Tensor], source: str | os.PathLike) -> Model:
    """The model an importer read from a file, built only once everything it read was checked:
    the sizes against the weights on the meta device (as ``check_config_fits``: a key
    ``blocks.1000.`` fails before 1,001 blocks are allocated), and every value the model takes
    (``check_weight_values``). The caller's random state is left as it was (building draws
    initial weights the file's replace).

    Raises:
        CheckpointError: the weights do not fit ``config``, or hold values no weight holds.
        ConfigError: a config the model refuses.
    """
    shell = _meta_model(config, state_dict, source)
    check_weight_values({name: tensor.dtype for name, tensor in shell.state_dict().items()}, state_dict, source)
    load_weights(shell, state_dict, source, assign=True)
    with torch.random.fork_rng(devices=[]):
        model = build_model(config)
    load_weights(model, state_dict, source)
    return model.eval()


def check_weight_values(dtypes: dict[str, torch.dtype], state_dict: dict[str, Tensor], source: str | os.PathLike) -> None:
    """Refuse, by name, a tensor of ``state_dict`` that a model whose tensors have ``dtypes`` (by
    name) would take without a word:
    integers or booleans for a floating-point weight (``load_state_dict`` casts them), and NaN or
    infinite values (a model of them answers NaN for every input).

    Raises:
        CheckpointError: the first such tensor, named with what it holds.
    """
    for name, expected in dtypes.items():
        found = state_dict.get(name)
        if found is None or not expected.is_floating_point:
            continue
        if not found.is_floating_point():
            raise CheckpointError(f"checkpoint {source}: {name} holds {found.dtype} values; a weight is floating point")
        if not bool(torch.isfinite(found).all()):
            bad = int((~torch.isfinite(found)).sum())
            raise CheckpointError(f"checkpoint {source}: {name} holds {bad:,} NaN or infinite values of {found.numel():,}")


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

"""The papers' own checkpoints as deploykit models (``deploykit import gridpe|mope|wepe FILE``).

Each paper's repository saves its trained model in a file of its own shape; an importer reads that
file exactly as the official training script writes it (``read_training_checkpoint``: the
container, the EMA copy, the script's ``args``), reads everything the file holds (depth from the
block keys, heads where the weights say so, classes, ...) and asks only for what it does not hold
(an ``Assumption``, with the official script's default, named in the output). The model it returns
computes the official forward; ``save_model`` writes it as a model directory that ``export -c``,
``validate``, ``profile`` and ``serve`` take with no ``config.json`` of the user's.

An importer module provides ``convert(checkpoint: TrainingCheckpoint, ema: bool, **assumed) ->
Imported`` (both in ``deploykit.nn.checkpoint``, beside the converters, which import nothing from
here); ``IMPORTERS`` names them, and the CLI makes one ``deploykit import`` command of each.
This module imports no PyTorch (the CLI builds its commands from it); ``convert`` does.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deploykit.errors import ConfigError, unknown_choice

if TYPE_CHECKING:
    from deploykit.nn.checkpoint import Imported


@dataclass(frozen=True)
class Assumption:
    """A value an importer needs that the file does not hold: the official script's default,
    overridable as ``--<name>`` (underscores as hyphens)."""

    name: str
    default: Any
    help: str


@dataclass(frozen=True)
class Importer:
    """One source of checkpoints: a paper's training script, or (``vit``) any code that saves a
    timm-named ViT.

    Attributes:
        name: the ``deploykit import`` source (``gridpe``).
        paper: the encoding and the trunk it trains, for help and output.
        repository: the official repository (GitHub ``owner/name``).
        writes: the script and the file it saves.
        module: the module with ``convert``.
        assumptions: what the file does not hold.
    """

    name: str
    paper: str
    repository: str
    writes: str
    module: str
    assumptions: tuple[Assumption, ...] = ()
    # ``--set`` options go to ``convert`` (they shape the model the weights fill) instead of being
    # applied to the model it returns.
    takes_options: bool = False

    def convert(self, path: str | os.PathLike, ema: bool = False, options=(), **assumed: Any) -> Imported:
        """Read ``path`` and build the model (``options``: ``key=value`` encoding options, applied to the
        model the converter returns, or given to the converter when it ``takes_options``)."""
        known = {a.name for a in self.assumptions}
        unknown = sorted(set(assumed) - known)
        if unknown:
            raise ConfigError(f"deploykit import {self.name} takes no option {unknown[0]!r}; it takes {', '.join(sorted(known)) or 'none'}")
        from deploykit.nn.checkpoint import read_training_checkpoint, with_encoding_options

        values = {a.name: assumed.get(a.name, a.default) for a in self.assumptions}
        checkpoint = read_training_checkpoint(path)
        converter = importlib.import_module(self.module).convert
        if self.takes_options:
            return converter(checkpoint, ema, options=tuple(options), **values)
        imported = converter(checkpoint, ema, **values)
        if options:
            imported = imported.with_model(with_encoding_options(imported.model, options, str(path)))
        return imported


# One entry per official repository; ``deploykit import --help`` lists them in this order.
IMPORTERS: dict[str, Importer] = {
    importer.name: importer
    for importer in (
        Importer(
            "gridpe", "GridPE (DeiT-III trunk)", "BoyangL1/Gridpe", "VIT/deit/main.py's best_checkpoint.pth", "deploykit.nn.from_gridpe"
        ),
        Importer(
            "mope",
            "MoPE + EGA (causal language model)",
            "AthanasiosZeris/energy-gated-attention",
            "paper2_ega_mope/gpt_phase4_memfix.py's checkpoint",
            "deploykit.nn.from_mope",
        ),
        Importer(
            "wepe",
            "WePE (ViT-Ti)",
            "1131230221/Weierstrass-Elliptic-Function-Positional-Encoding",
            "W_Ti.py's model.state_dict()",
            "deploykit.nn.from_wepe",
            (
                Assumption("num_heads", 3, "Attention heads per block: nn.MultiheadAttention's weights do not say (W_Ti.py: 3)."),
                Assumption("img_size", 224, "Training resolution, the model's default input: WePE holds no grid (W_Ti.py: 224)."),
            ),
        ),
        Importer(
            "vit",
            "a ViT or DeiT-III trained elsewhere with a deploykit encoding (SaPE², GeoPE, ...)",
            "your own training code",
            "a state dict in timm's ViT names plus the encoding's parameters, bare or in a training container",
            "deploykit.nn.from_state_dict",
            (
                Assumption("model", "vit_small_patch16", "The size whose head count the weights take (a packed qkv does not record it)."),
                Assumption("encoding", "ape", "The encoding the model was trained with; its options with --set (e.g. mode=k)."),
                Assumption("img_size", 0, "Training resolution where no learned APE gives it (0: the size's own)."),
            ),
            takes_options=True,
        ),
    )
}


def get_importer(name: str) -> Importer:
    if name not in IMPORTERS:
        raise ConfigError(unknown_choice("import source", name, sorted(IMPORTERS)))
    return IMPORTERS[name]

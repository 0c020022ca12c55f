"""Train a zoo model on the shape-relations dataset, seeded and reproducible on CPU.

Reproducible: the weights come from ``torch.manual_seed(settings.seed)``, step ``t`` trains on
train samples ``[t·B, (t+1)·B)`` (each drawn from its own seeded stream), and nothing else is
random, so the same command gives the same weights on the same torch build and thread count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deploykit.encodings import get_config
from deploykit.errors import ConfigError
from deploykit.inputs.builtin import normalise
from deploykit.inputs.datasets import ShapeRelations, get_dataset
from deploykit.nn.checkpoint import WEIGHTS_FILE, save_model
from deploykit.nn.factory import Model, create_model
from deploykit.zoo.registry import BASE_MODEL, ZooEntry, get_entry, model_dir


@dataclasses.dataclass
class TrainResult:
    name: str
    steps: int
    final_loss: float
    val_accuracy: float
    seconds: float
    directory: str


def build_zoo_model(entry: ZooEntry) -> Model:
    """The untrained model of a zoo entry, its weights drawn from the global torch generator."""
    encoding = get_config(entry.encoding, **entry.encoding_options)
    return create_model(BASE_MODEL, encoding=encoding, **entry.model_overrides)


def model_input(images: np.ndarray, model: Model) -> torch.Tensor:
    """``[N, 3, H, W]`` pixels in [0, 1] → the model's normalised input."""
    return torch.from_numpy(normalise(images, model.cfg.mean, model.cfg.std))


def learning_rate(step: int, settings) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to 0 at ``steps``."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def correct_predictions(
    model: Model, dataset: ShapeRelations, split: str, resolution: int, limit: int | None = None, batch_size: int = 200
) -> np.ndarray:
    """Whether each of the first ``limit`` samples of a fixed ``split`` (all when None) is
    classified right, rendered at ``resolution``: bool ``[n]``."""
    count = min(limit or dataset.size(split), dataset.size(split))
    model.eval()
    correct = []
    for start in range(0, count, batch_size):
        images, labels = dataset.batch(split, range(start, min(start + batch_size, count)), resolution)
        correct.append(model(model_input(images, model)).argmax(-1).numpy() == labels)
    return np.concatenate(correct)


def train(
    name: str,
    root: Path | None = None,
    steps: int | None = None,
    progress: Callable[[int, int, dict], None] | None = None,
    threads: int = 1,
    force: bool = False,
) -> TrainResult:
    """Train zoo entry ``name`` and save it to ``root/name`` (default ``models/name``).

    Args:
        name: a zoo entry (``deploykit.zoo.registry.list_zoo()``).
        root: directory holding zoo models.
        steps: override the entry's step count (short runs for tests).
        progress: called as ``progress(step, total, metrics)`` after every step.
        threads: torch intra-op threads while training (restored after). One thread is the
            fastest on a shared 2-core machine (two threads contend with the other jobs) and keeps
            float reductions in one order.
        force: replace a trained model already in ``root/name`` (refused otherwise, before training).

    Raises:
        ConfigError: unknown name, or a trained model is there and ``force`` is False.
    """
    check_destination(name, root, force)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(get_entry(name), root, steps, progress)
    finally:
        torch.set_num_threads(previous)


def check_destination(name: str, root: Path | None = None, force: bool = False) -> Path:
    """``root/name``, where ``train`` saves; refused when a trained model is there and not ``force``.

    Raises:
        ConfigError: unknown name, or a trained model would be replaced without ``force``.
    """
    directory = model_dir(name, root)
    if (directory / WEIGHTS_FILE).exists() and not force:
        raise ConfigError(f"{directory} already holds a trained model; pass --force to replace it")
    return directory


def _train(entry: ZooEntry, root: Path | None, steps: int | None, progress) -> TrainResult:
    name = entry.name
    settings = entry.train if steps is None else dataclasses.replace(entry.train, steps=steps)
    torch.manual_seed(settings.seed)
    model = build_zoo_model(entry)
    dataset = get_dataset(model.cfg.dataset)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos_embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
    )
    start, loss_avg, val_acc = time.perf_counter(), float("nan"), float("nan")
    for step in range(settings.steps):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        indices = range(step * settings.batch_size, (step + 1) * settings.batch_size)
        images, labels = dataset.batch("train", indices, model.cfg.img_size)
        loss = F.cross_entropy(model(model_input(images, model)), torch.from_numpy(labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        loss_avg = loss.item() if step == 0 else 0.95 * loss_avg + 0.05 * loss.item()
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            val_acc = float(correct_predictions(model, dataset, "val", model.cfg.img_size).mean())
        if progress:
            progress(step + 1, settings.steps, dict(loss=loss_avg, val_acc=val_acc))
    directory = model_dir(name, root)
    command = f"deploykit zoo train {name}" + (f" --steps {settings.steps}" if settings.steps != entry.train.steps else "")
    meta = dict(zoo_name=name, command=command, val_accuracy=json.dumps(val_acc), train_settings=json.dumps(dataclasses.asdict(settings)))
    save_model(model.eval(), directory, metadata=meta)
    return TrainResult(name, settings.steps, loss_avg, val_acc, time.perf_counter() - start, str(directory))

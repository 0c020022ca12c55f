"""Model cards: test accuracy at the training resolution and at 1.5× and 2× (the extrapolation
table the encoding papers discuss), written as ``card.json`` + ``card.md`` beside each zoo model,
and the ``models/README.md`` summary table generated from the cards.

``card.json`` also keeps, per resolution, which test samples the model got right (a hex bit
mask, sample 0 in the lowest bit), so an evaluation of any prefix of the test split can be
checked against the card exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deploykit._io import write_json_atomic, write_text_atomic
from deploykit._version import __version__
from deploykit.encodings import config_to_dict
from deploykit.errors import CheckpointError, ConfigError
from deploykit.inputs.builtin import normalise
from deploykit.inputs.datasets import CLASSES, get_dataset
from deploykit.nn.checkpoint import WEIGHTS_FILE, load_model
from deploykit.nn.factory import Model
from deploykit.zoo.registry import EVAL_SCALES, ZOO, get_entry, model_dir, zoo_dir
from deploykit.zoo.train import correct_predictions

CARD_JSON, CARD_MD, README = "card.json", "card.md", "README.md"


def eval_resolutions(model: Model) -> list[int]:
    """The card's resolutions: ``EVAL_SCALES`` × the training size, each a multiple of the patch."""
    size, patch = model.cfg.img_size, model.cfg.patch_size
    return [int(round(size * s / patch)) * patch for s in EVAL_SCALES]


def evaluate(name: str, root: Path | None = None, limit: int | None = None, int8: bool = True) -> dict[str, Any]:
    """The card of a trained zoo model (test accuracy on the first ``limit`` test samples): the
    PyTorch model, and with ``int8`` its exported ``int8`` plan in ONNX Runtime (``int8_columns``)."""
    directory = model_dir(name, root)
    if not (directory / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"zoo model {name} is not trained ({directory / WEIGHTS_FILE} missing); run: deploykit zoo train {name}")
    model, train_settings = load_model(directory), _train_settings(directory)
    dataset = get_dataset(model.cfg.dataset)
    resolutions = eval_resolutions(model)
    correct = [correct_predictions(model, dataset, "test", r, limit) for r in resolutions]
    entry = get_entry(name)
    return dict(
        **_fp32_columns(name, model, dataset, resolutions, correct, directory, train_settings, entry),
        **(int8_columns(model, dataset, resolutions, limit) if int8 else {}),
    )


def int8_columns(model: Model, dataset, resolutions: list[int], limit: int | None = None) -> dict[str, Any]:
    """Test accuracy of the model's ``int8`` plan at each resolution, exported and calibrated as
    ``deploykit export --precision int8`` does (train split, agreement target on the val split),
    run in ONNX Runtime; the share of test predictions it shares with the fp32 graph, with its
    binomial standard error (the test split is used by neither calibration nor the fallback)."""
    from deploykit.checks import Agreement, Reference, check_runner
    from deploykit.export import onnx_from_model
    from deploykit.export.bundle import planned_graph
    from deploykit.export.metadata import GraphMetadata
    from deploykit.runners.onnxrt import cpu_runner, run_graph

    count = min(limit or dataset.size("test"), dataset.size("test"))
    accuracy, agreement, error, correct_hex, plans = [], [], [], [], []
    for r in resolutions:
        fp32 = onnx_from_model(model, (r, r))
        int8 = planned_graph(fp32, model, (r, r), "int8")
        images, labels = dataset.batch("test", range(count), r)
        inputs = normalise(images, model.cfg.mean, model.cfg.std)
        with cpu_runner(int8) as runner:  # the fallback's criterion, without a bar: its counted top-1 agreement
            checked = check_runner(runner, Reference(inputs, run_graph(fp32, inputs), num_real=count), (Agreement(),), batch=32)
        predicted = checked.outputs.argmax(-1)
        accuracy.append(float(np.mean(predicted == labels)))
        agreement.append(checked.result.metrics["top1_agreement"])
        error.append(float(np.sqrt(agreement[-1] * (1 - agreement[-1]) / count)))
        correct_hex.append(_bits_to_hex(predicted == labels))
        details = GraphMetadata.of(int8).quantization
        kept = [f"{e.module} ({e.onnx}): {e.reason}" for e in details.kept_float if e.reason != "policy"]
        checks = (details.agreement or {}).get("checks", 0)
        plans.append({"float_nodes": details.float_nodes, "quantized_nodes": details.quantized_nodes, "kept_float": kept, "checks": checks})
    return dict(
        int8_test_accuracy=accuracy,
        int8_test_correct_hex=correct_hex,
        int8_agreement_with_fp32=agreement,
        int8_agreement_standard_error=error,
        int8_plans=plans,
    )


def _fp32_columns(name, model, dataset, resolutions, correct, directory, train_settings, entry) -> dict[str, Any]:
    return dict(
        name=name,
        encoding=config_to_dict(model.cfg.encoding),
        dataset=model.cfg.dataset,
        classes=list(CLASSES),
        chance=1 / dataset.num_classes,
        train_resolution=model.cfg.img_size,
        resolutions=resolutions,
        num_test=len(correct[0]),
        test_accuracy=[float(c.mean()) for c in correct],
        test_correct_hex=[_bits_to_hex(c) for c in correct],
        num_params=sum(p.numel() for p in model.parameters()),
        weights_bytes=(directory / WEIGHTS_FILE).stat().st_size,
        model=_trunk(model),
        train_settings=train_settings,
        eval_command=f"deploykit zoo eval {name}",
        overrides=entry.model_overrides,
        deploykit_version=__version__,
        torch_version=torch.__version__,
    )


def _trunk(model: Model) -> dict[str, Any]:
    cfg = model.cfg.to_dict()
    cfg.pop("encoding")
    return cfg


def _train_settings(directory: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS_FILE), "pt") as f:
        meta = f.metadata() or {}
    return dict(
        command=meta.get("command", "?"),
        val_accuracy=json.loads(meta.get("val_accuracy", "null")),
        settings=json.loads(meta.get("train_settings", "{}")),
    )


def _bits_to_hex(bits: np.ndarray) -> str:
    return hex(int("".join("1" if b else "0" for b in reversed(bits.tolist())) or "0", 2))


def hex_to_bits(text: str, count: int) -> np.ndarray:
    """Inverse of the card's bit mask: the first ``count`` samples' correctness."""
    value = int(text, 16)
    return np.array([(value >> i) & 1 for i in range(count)], dtype=bool)


def write_card(card: dict[str, Any], root: Path | None = None) -> Path:
    directory = model_dir(card["name"], root)
    write_json_atomic(directory / CARD_JSON, card)
    write_text_atomic(directory / CARD_MD, card_markdown(card))
    return directory


def card_markdown(card: dict[str, Any]) -> str:
    enc = dict(card["encoding"])
    enc_name = enc.pop("name")
    header = " | ".join(f"{r} px ({r / card['train_resolution']:g}×)" for r in card["resolutions"])
    accs = " | ".join(f"{a:.1%}" for a in card["test_accuracy"])
    int8_rows = []
    if "int8_test_accuracy" in card:
        int8_rows = [
            "| int8 (ONNX Runtime) | " + " | ".join(f"{a:.1%}" for a in card["int8_test_accuracy"]) + " |",
            "| int8 top-1 = fp32 | " + " | ".join(_agreement(card, i) for i in range(len(card["resolutions"]))) + " |",
        ]
    m, train = card["model"], card["train_settings"]
    lines = [
        f"# {card['name']}",
        "",
        f"ViT (patch {m['patch_size']}, width {m['embed_dim']}, depth {m['depth']}, {m['num_heads']} heads) with the "
        f"**{enc_name}** positional encoding, trained at {card['train_resolution']} px on `{card['dataset']}` "
        f"({len(card['classes'])} classes: where the square lies relative to the circle; chance {card['chance']:.0%}).",
        "",
        f"Test accuracy on {card['num_test']} test scenes, rendered at each resolution:",
        "",
        f"| | {header} |",
        "|---|" + "---|" * len(card["resolutions"]),
        f"| fp32 (PyTorch) | {accs} |",
        *int8_rows,
        "",
        *(
            [
                "The int8 plan is `deploykit export --precision int8`, run in ONNX Runtime on CPU: calibrated on 128 "
                "scenes of the train split; the matmuls whose int8 error at the output is largest moved back to float, "
                "as few as bisection finds for top-1 agreement >= 99.5% on the 1000 val scenes (counted and estimated "
                "pairwise). Agreement is on the test scenes neither step saw, ± one binomial standard error.",
                "",
                *(
                    f"- {r} px: {', '.join(plan['kept_float']) or 'every eligible matmul int8'}"
                    for r, plan in zip(card["resolutions"], card.get("int8_plans", []))
                    if "kept_float" in plan
                ),
                "",
            ]
            if int8_rows
            else []
        ),
        f"- parameters: {card['num_params']:,} ({card['weights_bytes'] / 1e6:.1f} MB safetensors)",
        f"- training: `{train['command']}` (seeded; {train['settings'].get('steps', '?')} steps of {train['settings'].get('batch_size', '?')} on CPU)",
        f"- training settings: {', '.join(f'{k}={v}' for k, v in train['settings'].items())}",
        f"- validation accuracy at the end of training: {train['val_accuracy']}",
        f"- these numbers: `{card['eval_command']}` (torch {card['torch_version']}, deploykit {card['deploykit_version']})",
        "",
        "Encoding configuration (every paper-ambiguity choice, as saved in `config.json`):",
        "",
        "| option | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in enc.items()),
        "",
    ]
    return "\n".join(lines)


def read_cards(root: Path | None = None) -> list[dict[str, Any]]:
    """The cards of every trained zoo model, in registry order."""
    root = root or zoo_dir()
    return [json.loads((root / n / CARD_JSON).read_text()) for n in ZOO if (root / n / CARD_JSON).is_file()]


def write_readme(root: Path | None = None) -> Path:
    """Regenerate ``models/README.md`` from the cards."""
    root = root or zoo_dir()
    cards = read_cards(root)
    untrained = [n for n in ZOO if not (root / n / CARD_JSON).is_file()]
    rows = [_summary_row(c) for c in cards]
    lines = [
        "# Model zoo",
        "",
        "Generated by `deploykit zoo eval` (or `deploykit zoo cards`) from each model's `card.json`; do not edit.",
        "",
        "Small ViTs trained on the procedurally rendered `shape-relations` dataset (`deploykit.inputs.datasets`: "
        "4 classes, chance 25%), one per positional encoding. Test accuracy on the test split rendered at the "
        "training resolution and at 1.5× and 2× (no fine-tuning: the resolution-extrapolation table), for the PyTorch "
        "model (fp32) and for its `int8` plan in ONNX Runtime, with the share of test predictions the int8 plan shares "
        "with the fp32 graph (worst of the three resolutions, ± one binomial standard error in points).",
        "",
        "| model | encoding | params | fp32 1× | 1.5× | 2× | int8 1× | 1.5× | 2× | int8 = fp32 (worst) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if untrained:
        lines += ["Not trained yet: " + ", ".join(f"`{n}` (`deploykit zoo train {n}`)" for n in untrained), ""]
    return write_text_atomic(root / README, "\n".join(lines))


def _summary_row(card: dict[str, Any]) -> str:
    cells = [f"[{card['name']}]({card['name']}/card.md)", card["encoding"]["name"], f"{card['num_params']:,}"]
    cells += [f"{a:.1%}" for a in card["test_accuracy"]]
    if "int8_test_accuracy" in card:  # cards written before the int8 columns have none
        worst = int(np.argmin(card["int8_agreement_with_fp32"]))
        cells += [f"{a:.1%}" for a in card["int8_test_accuracy"]] + [_agreement(card, worst)]
    else:
        cells += ["–"] * 4
    return "| " + " | ".join(cells) + " |"


def _agreement(card: dict[str, Any], i: int) -> str:
    """``99.35% ± 0.18`` (two decimals: 98.95% is not 99.0%); without the error on older cards."""
    value = f"{card['int8_agreement_with_fp32'][i]:.2%}"
    errors = card.get("int8_agreement_standard_error")
    return f"{value} ± {100 * errors[i]:.2f}" if errors else value


def rewrite_cards(root: Path | None = None) -> Path:
    """Rewrite each ``card.md`` and the summary table from the ``card.json`` files."""
    for card in read_cards(root):
        write_text_atomic(model_dir(card["name"], root) / CARD_MD, card_markdown(card))
    return write_readme(root)


def evaluate_zoo(names: Iterable[str] = (), root: Path | None = None, limit: int | None = None, int8: bool = True) -> list[dict[str, Any]]:
    """Evaluate ``names`` (default: every trained zoo model); on the full test split, also write
    their cards and the summary table. Without ``int8`` (the int8 plans are most of the time),
    only a ``limit``-ed look: a card is never written without its int8 columns."""
    if not int8 and limit is None:
        raise ConfigError("the int8 columns are part of every card: skip them only with a --limit")
    root = root or zoo_dir()
    names = list(names) or [n for n in ZOO if (root / n / WEIGHTS_FILE).is_file()]
    cards = [evaluate(n, root, limit, int8) for n in names]
    if limit is None:
        for card in cards:
            write_card(card, root)
        write_readme(root)
    return cards

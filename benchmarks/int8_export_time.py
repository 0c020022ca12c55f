"""How long ``deploykit export --precision int8`` takes, fallback included, beside the fp32 export.

The issue's figure: an int8 export of ViT-S/16 at 224 with 256 calibration inputs, on the 2-core
CI machine, quiet, in at most 5 minutes. Both exports run in one process, one after the other,
through the same ``deploykit.export.export`` the command line calls, on a folder of images
(``--calibration-data``: decoding and the model's preprocessing are part of the time):

    python benchmarks/int8_export_time.py                       # ViT-S/16, 224, 256 + 256 inputs
    python benchmarks/int8_export_time.py --checkpoint vit_s/   # a trained model (deploykit import timm ...)
    python benchmarks/int8_export_time.py --quick               # smoke: a 2-block model at 32 px, 16 + 16 inputs

Without ``--checkpoint`` the model is the seeded (untrained) ViT-S/16: its agreement says nothing
about accuracy, but the work is the same. The images are written once into a temporary folder:
seeded crops (35-100% of the area, mirrored half the time) of scikit-image's bundled samples,
saved as JPEG at 500 px on the long side, like photos from disk.

An untimed export of a one-block model runs first, so neither timed export pays torch.onnx's
one-time start-up. The JSON (``results/int8-export-time.json``; ``--quick`` prints it and writes none) holds both wall times, the time of each step
of the int8 export (from its progress lines: loading and preprocessing the inputs with the fp32
reference, calibration, the one-pass sensitivity, each agreement check), how many checks the
fallback made and the most it may make (``2 + ceil(log2(budget))``), the latter's projected
time from the measured mean check, and the CPU's instruction sets (int8 speed depends on VNNI).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment, environment_line
from deploykit.export import export
from deploykit.export.int8_static import CalibrationOptions
from deploykit.export.sensitivity import QualityTarget
from deploykit.inputs.builtin import sample_images
from deploykit.inputs.user import UserCalibration, read_inputs
from deploykit.nn import create_model
from deploykit.zoo.resolve import resolve_model

RESULTS = Path(__file__).parent / "results"


def write_images(directory: Path, count: int, long_side: int, seed: int = 0) -> None:
    """``count`` JPEG crops of the bundled sample images (seeded), ``long_side`` px on the long side."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = sample_images()
    for i in range(count):
        image = images[i % len(images)]
        h, w = image.shape[:2]
        area, aspect = rng.uniform(0.35, 1.0) * h * w, np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        ch, cw = min(h, int((area / aspect) ** 0.5)), min(w, int((area * aspect) ** 0.5))
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        crop = Image.fromarray(np.ascontiguousarray(image[top : top + ch, left : left + cw]))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        scale = long_side / max(crop.size)
        crop = crop.convert("RGB").resize((max(1, round(crop.width * scale)), max(1, round(crop.height * scale))), Image.Resampling.BICUBIC)
        crop.save(directory / f"{i:04d}.jpg", quality=90)


class Steps:
    """The export's progress lines with the time each arrived (``perf_counter_ns``)."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self.start = time.perf_counter_ns()

    def __call__(self, message: str) -> None:
        self.lines.append(((time.perf_counter_ns() - self.start) / 1e9, message))
        print(f"  {self.lines[-1][0]:7.1f} s  {message}", flush=True)

    def phases(self, total_s: float) -> list[dict]:
        """Each step's duration: until the next line (the last: until the export returned)."""
        ends = [t for t, _ in self.lines[1:]] + [total_s]
        return [{"step": message, "start_s": start, "seconds": end - start} for (start, message), end in zip(self.lines, ends)]


def timed_export(model, resolution, output: Path, precisions, calibration, label: str) -> tuple[float, Steps, object]:
    print(f"{label}:", flush=True)
    steps = Steps()
    start = time.perf_counter_ns()
    manifest = export(model, [resolution], output, precisions=precisions, calibration=calibration, progress=steps)
    seconds = (time.perf_counter_ns() - start) / 1e9
    print(f"  {seconds:7.1f} s  done", flush=True)
    return seconds, steps, manifest


def fallback_summary(details: dict, phases: list[dict]) -> dict:
    """Checks made and the most the bisection may make, with that bound's projected time."""
    agreement = details.get("agreement") or {}
    checks = [p["seconds"] for p in phases if " matmuls float: " in p["step"]]
    quantizable = details["quantized_nodes"] + sum(1 for e in details["kept_float"] if e["reason"] == "sensitivity")
    budget = int(quantizable * QualityTarget.max_float_share)
    most = 2 + math.ceil(math.log2(budget)) if budget > 1 else 1 + budget
    mean_check = float(np.mean(checks)) if checks else None
    return {
        "checks": agreement.get("checks", 0),
        "most_checks": most,
        "check_seconds": checks,
        "mean_check_s": mean_check,
        "target_met": agreement.get("met"),
        "quantized_all": agreement.get("quantized_all"),
        "final": agreement.get("final"),
        "kept_float": [f"{e['module']} ({e['onnx']}): {e['reason']}" for e in details["kept_float"] if e["reason"] != "policy"],
        "most_sensitive": details.get("sensitivity", {}).get("most_sensitive"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: a 2-block ViT at 32 px, 16 + 16 inputs (prints its JSON, writes none)"
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="model directory to export (default: seeded ViT-S/16)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--samples", type=int, default=256, help="calibration inputs")
    parser.add_argument("--held-out", type=int, default=256, help="held-out inputs the fallback checks agreement on")
    parser.add_argument("--data", type=Path, default=None, help="a folder of images (default: bundled crops written to a temp folder)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default: results/int8-export-time.json; --quick: none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.resolution, args.samples, args.held_out = 32, 16, 16
    environment = capture_environment(torch.device("cpu"))
    print(environment_line(environment), flush=True)
    if args.checkpoint is not None:
        model, source = resolve_model(checkpoint=args.checkpoint)
    else:
        torch.manual_seed(0)
        sizes = dict(depth=2, img_size=32, embed_dim=64, num_heads=2) if args.quick else {}
        model, source = create_model("vit_small_patch16", encoding="ape", **sizes).eval(), "seeded vit_small_patch16 (untrained)"
    resolution = (args.resolution, args.resolution)
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-time-") as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "images"
            data.mkdir()
            write_images(data, args.samples + args.held_out, 64 if args.quick else 500)
        calibration = CalibrationOptions(samples=args.samples, held_out=args.held_out, data=UserCalibration(read_inputs(data)))
        # Untimed: torch.onnx's first export loads and compiles what later ones reuse.
        export(create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=10).eval(), [(32, 32)], Path(tmp) / "warm-up")
        fp32_s, _, _ = timed_export(model, resolution, Path(tmp) / "fp32", ["fp32"], calibration, "fp32 export")
        int8_s, steps, manifest = timed_export(model, resolution, Path(tmp) / "int8", ["int8"], calibration, "int8 export")
    details = manifest.graph(resolution, "int8").quantization  # fp32 is written first, beside it
    phases = steps.phases(int8_s)
    fallback = fallback_summary(details, phases)
    projected = (
        None
        if fallback["mean_check_s"] is None
        else int8_s + (fallback["most_checks"] - len(fallback["check_seconds"])) * fallback["mean_check_s"]
    )
    result = {
        "command": "python benchmarks/int8_export_time.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
        "environment": environment,
        "model": source,
        "resolution": list(resolution),
        "calibration_inputs": args.samples,
        "held_out_inputs": args.held_out,
        "fp32_export_s": fp32_s,
        "int8_export_s": int8_s,
        "int8_export_min": int8_s / 60,
        "int8_over_fp32": int8_s / fp32_s,
        "int8_phases": phases,
        "fallback": fallback,
        "int8_export_with_most_checks_s": projected,
        "goal": "int8 export <= 300 s (ViT-S/16, 224, 256 calibration inputs, fallback included; 2-core CI machine, quiet)",
    }
    path = args.output or (None if args.quick else RESULTS / "int8-export-time.json")
    if path is None:
        print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1), flush=True)
    else:
        write_json_atomic(path, result)
    print(
        f"fp32 export {fp32_s:.1f} s, int8 export {int8_s:.1f} s ({int8_s / 60:.2f} min, {fallback['checks']} of at most "
        f"{fallback['most_checks']} agreement checks; with all of them ~{projected or int8_s:.1f} s)" + (f"; wrote {path}" if path else ""),
        flush=True,
    )


if __name__ == "__main__":
    main()

"""What float32 denormals cost ONNX Runtime on real inputs, and what flushing them changes.

    python benchmarks/denormals.py            # the default zoo model at 384 and a seeded ViT-S at 224, 16 held-out images
    python benchmarks/denormals.py --quick    # smoke: fp32 only, at 96 px, 2 images, 1 round

The default model's trained attention is so peaked on some images that softmax writes
probabilities below float32's normal range, and every ``attn @ v`` product with one takes a
microcode assist. deploykit's ONNX Runtime runner flushes denormals to zero in ONNX Runtime's
threads (``session.set_denormal_as_zero``) and in the calling thread (``deploykit.runners.cpu``).

Two lanes per plan (fp32, fp32-mha, int8), on the same graph, one image at a time, interleaved
image by image and round by round: ``flushed`` (``OnnxrtRunner``, as validate, profile, serve
and the exporter's checks run it) and ``as ONNX Runtime ships`` (the same session options without
the flush, the calling thread not flushing either). Per image: the lane's fastest call over the
rounds. Recorded: per-image latencies, their mean/median/max, the ratio of the means in the same
run, and the largest difference between the two lanes' outputs (flushing changed none here).

Writes ``benchmarks/results/denormals.json`` (``denormals-quick.json`` with ``--quick``), with the
CPU's instruction sets.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from results_file import write_results

from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import CalibrationOptions
from deploykit.inputs.builtin import calibration_inputs
from deploykit.nn import create_model
from deploykit.runners.cpu import flushing_denormals
from deploykit.runners.onnxrt import CPU, OnnxrtRunner, session_options
from deploykit.zoo.resolve import resolve_model

RESULTS = Path(__file__).parent / "results"
SPEED_CALIBRATION = CalibrationOptions(samples=16, held_out=16, min_agreement=None)


class _Unflushed:
    """The same session as ``OnnxrtRunner``'s, as ONNX Runtime ships it: denormals kept."""

    def __init__(self, graph: bytes):
        import onnxruntime as ort

        opts = session_options()
        opts.add_session_config_entry("session.set_denormal_as_zero", "0")  # ONNX Runtime's default
        self._session = ort.InferenceSession(graph, opts, providers=[CPU])

    def infer(self, feed):
        assert not flushing_denormals(), "the calling thread must not flush for this lane"
        names = [o.name for o in self._session.get_outputs()]
        return dict(zip(names, self._session.run(names, feed)))


def _summary(ms: list[float]) -> dict:
    return dict(
        mean_ms=float(np.mean(ms)), median_ms=float(np.median(ms)), max_ms=float(np.max(ms)), per_image_ms=[round(v, 2) for v in ms]
    )


def measure_cell(model, label: str, resolution: int, plans: list[str], count: int, rounds: int) -> list[dict]:
    """Both lanes of every plan on ``count`` held-out images of ``model`` at ``resolution``."""
    shape = (resolution, resolution)
    with torch.inference_mode():
        fp32 = onnx_from_model(model, shape)
        graphs = {p: g.SerializeToString() for p, g in planned_graphs(fp32, model, shape, plans, SPEED_CALIBRATION)}
    images, source = calibration_inputs(model, shape, count, held_out=True)
    lanes = {}
    for plan, graph in graphs.items():
        flushed = OnnxrtRunner(graph, providers=[CPU])
        flushed.activate()
        lanes[plan, "flushed"], lanes[plan, "as ONNX Runtime ships"] = flushed, _Unflushed(graph)
    outputs = {lane: [] for lane in lanes}
    best = {lane: [float("inf")] * count for lane in lanes}
    for round_ in range(rounds):
        for i in range(count):
            feed = {"images": images[i : i + 1]}
            for lane, runner in lanes.items():
                runner.infer(feed)  # warm, on this image
                t0 = time.perf_counter_ns()
                out = runner.infer(feed)["logits"]
                best[lane][i] = min(best[lane][i], (time.perf_counter_ns() - t0) / 1e6)
                if round_ == 0:
                    outputs[lane].append(out)
    records = []
    for plan in graphs:
        kept, flushed = best[plan, "as ONNX Runtime ships"], best[plan, "flushed"]
        difference = np.abs(np.concatenate(outputs[plan, "flushed"]) - np.concatenate(outputs[plan, "as ONNX Runtime ships"])).max()
        records.append(
            dict(
                model=label,
                resolution=resolution,
                images=source,
                plan=plan,
                flushed=_summary(flushed),
                as_shipped=_summary(kept),
                mean_ratio_flushed_vs_as_shipped=float(np.mean(flushed) / np.mean(kept)),
                slowest_image_ratio=float(max(kept) / flushed[int(np.argmax(kept))]),
                max_abs_output_difference=float(difference),
            )
        )
        print(
            f"{label} @ {resolution} {plan}: mean {np.mean(kept):.1f} -> {np.mean(flushed):.1f} ms per image "
            f"({records[-1]['mean_ratio_flushed_vs_as_shipped']:.2f}x), slowest image {max(kept):.0f} ms, "
            f"outputs differ by at most {difference:.3g}",
            flush=True,
        )
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: fp32 at 96 px, 2 images, 1 round")
    parser.add_argument("--images", type=int, default=16, help="held-out images, each timed alone")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each image's fastest call counts)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    count, rounds = (2, 1) if args.quick else (args.images, args.rounds)
    default, label = resolve_model()
    cells = [(default.eval(), label, 96, ["fp32"])]
    if not args.quick:
        # The default model where its attention is peaked, and a seeded ViT-S/16 whose attention
        # is not (no denormals to flush): what flushing costs where it gains nothing.
        torch.manual_seed(0)
        cells = [
            (default.eval(), label, 384, ["fp32", "fp32-mha", "int8"]),
            (create_model("vit_small_patch16", encoding="ape").eval(), "vit_small_patch16 ape (seeded)", 224, ["fp32"]),
        ]
    write_results(
        __file__,
        argv,
        args.output_dir,
        args.quick,
        lambda: dict(rounds=rounds, records=[record for cell in cells for record in measure_cell(*cell, count, rounds)]),
    )


if __name__ == "__main__":
    main()

"""One graph for a range of resolutions: 2-D RoPE exported once for any size from min to max.

Encodings whose tables of a smaller grid are the top-left crop of a larger grid's (2-D RoPE,
GridPE, GeoPE) bake the largest grid's tables and crop them inside the graph, so one ONNX file
takes every height and width in the range. ``validate`` checks it at its min, opt and max, and
``deploykit build --dynamic`` turns it into one TensorRT engine for the whole range (the
in-process pipeline and ``deploykit serve`` serve fixed-resolution graphs).

    python examples/resolution_range.py --out out/rope-any
"""

import argparse

import deploykit

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", default="out/rope-any", help="export directory to write")
parser.add_argument("--quick", action="store_true", help="a tiny model (the test suite's run)")
args = parser.parse_args()

size = dict(depth=1, img_size=32, num_classes=10) if args.quick else {}
low, opt, high = ((32, 32), (48, 48), (64, 64)) if args.quick else ((224, 224), (384, 384), (512, 512))
model = deploykit.create_model("vit_tiny_patch16", encoding="rope-axial", **size).eval()

exported = deploykit.export(model, args.out, resolutions=[], resolution_range=(low, opt, high))
print([g.file for g in exported.manifest.graphs])  # model_<min>-<max>.onnx

report = deploykit.validate(exported.directory, num_random=2, num_real=2)
print([r["resolution"] for r in report.to_json()], "passed" if report else "FAILED")
report.raise_for_failure()

"""A zoo model end to end: export, validate, profile, serve in-process.

The zoo's trained APE ViT (``models/shapes-ape``, the embedded default) is exported with a CPU
INT8 plan beside fp32, checked against float64 PyTorch on its test images, timed plan by plan
(profile writes each resolution's fastest validated plan into the export directory) and loaded
as a classifier, which serves that plan. Everything goes through ``import deploykit``.

    python examples/zoo_end_to_end.py --out out/zoo
"""

import argparse

import numpy as np

import deploykit

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", default="out/zoo", help="export directory to write")
parser.add_argument("--quick", action="store_true", help="a short timing budget (the test suite's run)")
args = parser.parse_args()

exported = deploykit.export(None, args.out, precisions=["int8-dynamic"])
print(f"exported {[g.file for g in exported.manifest.graphs]} to {exported.directory}")

report = deploykit.validate(exported.directory, precision="int8-dynamic")
report.raise_for_failure()  # a DeployKitError naming each failed check
print(f"validated: {len(report.records)} checks passed")

profiled = deploykit.profile(exported.directory, batches=[1], duration_s=0.05 if args.quick else 1.0)
print("\n".join(profiled.report.advice) or "no advice")

classify = deploykit.load(exported.directory)
print(classify.describe_backends())
print(classify(np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)))

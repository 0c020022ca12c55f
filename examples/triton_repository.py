"""A Triton model repository from an export directory, ready for a GPU host's ``tritonserver``.

``deploykit package triton`` writes, per resolution, the ONNX Runtime and OpenVINO models (and
TensorRT ones where engines were built), a ``preprocess_<res>`` Python model that decodes and
preprocesses images exactly as deploykit does, and the ensembles joining them. Serve it with
``tritonserver --model-repository REPO``, or locally with ``deploykit serve EXPORT_DIR``.

    python examples/triton_repository.py --out out/triton
"""

import argparse
from pathlib import Path

import deploykit
from deploykit.cli import main

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", default="out/triton", help="folder for the export and the repository")
parser.add_argument("--quick", action="store_true", help="a tiny model (the test suite's run)")
args = parser.parse_args()

out = Path(args.out)
model = deploykit.create_model("vit_tiny_patch16", depth=1 if args.quick else 12, img_size=32 if args.quick else 224).eval()
exported = deploykit.export(model, out / "export")
try:  # the command line, as a deployment script would call it
    main(["package", "triton", str(exported.directory), "--output", str(out / "repo"), "--onnx-kind", "cpu"])
except SystemExit as done:
    if done.code:
        raise
for config in sorted((out / "repo").glob("*/config.pbtxt")):
    print(config.parent.name)

"""A paper's checkpoint, as its training script saved it: GridPE's DeiT-III to a validated export.

``deploykit import gridpe`` reads ``best_checkpoint.pth`` as the authors' ``main.py`` saves it
(model, EMA copy, the training arguments), takes the eval transform from those arguments, and
writes a model directory (``config.json`` + ``model.safetensors``) that every command takes. The
other papers' importers work the same way: ``deploykit import wepe``, ``deploykit import mope``
(``deploykit import --help``). ``--quick`` uses the tiny recording of the authors' format that the
test suite holds the importer to (``tests/nn/data/gridpe_best_checkpoint.pth``).

    python examples/paper_checkpoint.py --checkpoint best_checkpoint.pth --resolution 224 --out out/gridpe
"""

import argparse
from pathlib import Path

import deploykit
from deploykit.cli import main

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--checkpoint", help="the authors' best_checkpoint.pth")
parser.add_argument("--resolution", type=int, action="append", help="repeatable; default the training size")
parser.add_argument("--ema", action="store_true", help="import the EMA copy of the weights")
parser.add_argument("--out", default="out/gridpe")
parser.add_argument("--quick", action="store_true", help="the test suite's recording of the format")
args = parser.parse_args()
if args.quick:
    args.checkpoint = Path(__file__).resolve().parents[1] / "tests" / "nn" / "data" / "gridpe_best_checkpoint.pth"
if not args.checkpoint:
    parser.error("give --checkpoint (or --quick)")

out = Path(args.out)
try:  # the import step is a command: it reads the file as the authors' code saved it
    main(["import", "gridpe", str(args.checkpoint), *(["--ema"] if args.ema else []), "-o", str(out / "model")])
except SystemExit as done:
    if done.code:
        raise

resolutions = [(r, r) for r in args.resolution] if args.resolution else None
exported = deploykit.export(out / "model", out / "export", resolutions=resolutions)
report = deploykit.validate(exported.directory, num_real=2 if args.quick else None)
print(f"{exported.manifest.encoding}: {len(report.records)} checks, {'all passed' if report else 'FAILED'}")
report.raise_for_failure()

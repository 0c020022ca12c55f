"""Your timm model, INT8-calibrated on your own images.

``deploykit import timm NAME --weights FILE`` reads the checkpoint as timm reads it for that
model and records timm's preprocessing in ``config.json``; ``--calibration-data`` then calibrates
the INT8 plan on your images (preprocessed as served), and ``validate --inputs`` judges it on
others. Without ``--weights``, ``deploykit import timm`` takes timm's pretrained weights from the
hub. ``--quick`` stands in for the import step (timm and the hub are not needed): it writes a
tiny model directory of the same form (``config.json`` + ``model.safetensors``) and a few
generated images, then calibrates and validates as above.

    python examples/timm_with_your_images.py --weights vit_s.pth --images imgs/ --out out/timm
"""

import argparse
from pathlib import Path

import numpy as np

from deploykit.cli import main


def run(*argv: str) -> None:
    try:
        main(list(argv))
    except SystemExit as done:
        if done.code:
            raise


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--name", default="vit_small_patch16_224", help="the timm model name")
parser.add_argument("--weights", help="your checkpoint (.pth / .safetensors)")
parser.add_argument("--images", help="a folder of your images: the first half calibrates, the rest validates")
parser.add_argument("--out", default="out/timm")
parser.add_argument("--quick", action="store_true", help="a tiny timm ViT and generated images (the test suite's run)")
args = parser.parse_args()
out = Path(args.out)

if args.quick:  # what the import step writes, and a folder of images
    from PIL import Image

    import deploykit
    from deploykit.nn import save_model

    save_model(deploykit.create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=4).eval(), out / "model")
    args.images = str(out / "images")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        (Path(args.images) / split).mkdir(parents=True, exist_ok=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(Path(args.images) / split / f"{i}.png")
else:
    run("import", "timm", args.name, *(["--weights", args.weights] if args.weights else []), "-o", str(out / "model"))
images = Path(args.images)
calibration, held = (images / "train", images / "val") if (images / "train").is_dir() else (images, images)
run("export", "-c", str(out / "model"), "--precision", "int8", "--calibration-data", str(calibration), "-o", str(out / "export"))
run("validate", str(out / "export"), "--precision", "int8", "--inputs", str(held))

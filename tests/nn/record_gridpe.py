"""The official GridPE DeiT (BoyangL1/Gridpe, ``VIT/deit``) on a tiny seeded model: its
``best_checkpoint.pth`` exactly as ``main.py`` saves it, and the official forward's outputs, so
that CI holds ``deploykit import gridpe`` to the official code without running it (the official
code needs timm, which needs a torchvision that imports; see ``timm_reference.py``).

Run where a checkout of the repository is (``git clone https://github.com/BoyangL1/Gridpe``)::

    python tests/nn/record_gridpe.py --repo PATH/TO/Gridpe

It writes, beside this file:

* ``data/gridpe_best_checkpoint.pth``: the dict ``main.py`` saves (``model``, ``optimizer``,
  ``lr_scheduler``, ``epoch``, ``model_ema``, ``scaler``, ``args``), made by ``main.py``'s own
  objects: its argument parser given ``run_experiment.sh``'s flags (an ``argparse.Namespace``),
  timm's ``create_optimizer`` (one step taken, so its state holds tensors as a trained one's
  does), ``create_scheduler``, ``NativeScaler``, ``ModelEma``, and ``utils.save_on_master``.
* ``data/gridpe_reference.json``: the official model's logits on ``probe_images`` at every input
  size the paper evaluates (160 to 512) and a non-square one, for the ``model`` and the
  ``model_ema`` weights, each run as ``run_evaluation.sh`` does (the model built for that
  ``--input-size``, the checkpoint loaded into it), and the eval transform ``main.py`` builds
  (``datasets.build_transform(False, args)``).

The model is ``gridpe_deit_small_patch16_LS`` with its every argument but the sizes: width 48,
2 blocks, 2 heads (head dim 24: 4 scales of 3 directions), 10 classes. Its weights are the
counter-based hash of ``timm_reference.py`` (the EMA copy hashed under other keys); the GridPE
directions (``omegas``) are the official module's own random draw under ``main.py``'s seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import torch
from timm_reference import hashed_uniform, probe_images, tag

DATA = Path(__file__).with_name("data")
CHECKPOINT = DATA / "gridpe_best_checkpoint.pth"
FIXTURE = DATA / "gridpe_reference.json"

# The paper's evaluation sizes (run_evaluation.sh) and one non-square size the official code takes.
RESOLUTIONS = tuple((s, s) for s in (160, 192, 224, 256, 320, 384, 448, 512)) + ((192, 320),)
TINY = dict(embed_dim=48, depth=2, num_classes=10)
NUM_HEADS = 2
# run_experiment.sh's command line (EXTRA_ARGS included), the paths and the head count aside.
FLAGS = (
    "--model gridpe_deit_small_patch16_LS --data-path /data/imagenet100 --output_dir /runs/gridpe_deit_small_patch16_LS_2/pretrain "
    "--batch-size 32 --epochs 150 --lr 5e-4 --weight-decay 0.03 --input-size 224 "
    f"--num-heads {NUM_HEADS} --smoothing 0.0 --reprob 0.0 --opt adamw --color-jitter 0.3 --drop 0.0 --drop-path 0.0 "
    "--unscale-lr --repeated-aug --ThreeAugment --eval-crop-ratio 1.0 --dist-eval"
).split()


def import_official(repo: Path):
    """``main``, ``models_gridpe``, ``utils`` and ``datasets`` of the checkout at ``repo``."""
    sys.path[:0] = [str(repo / "VIT" / "deit")]
    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode:
        # PyPI's torchvision for a CPU torch is a CUDA build: its extension does not load, and its
        # Python package then fails registering fake kernels for two ops it cannot find. Declaring
        # them lets the package import; the official model uses no torchvision op.
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_official.keep = lib
    warnings.filterwarnings("ignore", category=FutureWarning)  # timm's deprecated import paths, used by the official code
    import datasets
    import main
    import models_gridpe
    import utils

    return main, models_gridpe, utils, datasets


def tiny_model(models_gridpe, img_size, num_heads: int):
    """``gridpe_deit_small_patch16_LS``'s construction (models_gridpe.py) at ``TINY`` sizes."""
    from torch import nn

    return models_gridpe.gridpe_vit_models(
        img_size=img_size,
        patch_size=16,
        num_heads=num_heads,
        mlp_ratio=4,
        qkv_bias=True,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        block_layers=models_gridpe.GridPE_Layer_scale_init_Block,
        Attention_block=models_gridpe.GridPEAttention,
        drop_rate=0.0,
        drop_path_rate=0.0,
        **TINY,
    )


def seeded(state: dict[str, torch.Tensor], salt: str) -> dict[str, torch.Tensor]:
    """Hashed weights for every tensor but the GridPE directions (kept): norms' scales near 1,
    everything else ±0.3 (LayerScale included, so every branch counts)."""
    out = {}
    for key, value in state.items():
        if key.endswith("grid_pe.omegas"):
            out[key] = value.clone()
            continue
        u = hashed_uniform(tuple(value.shape), salt + key)
        norm_scale = value.ndim == 1 and key.endswith(".weight") and "norm" in key
        out[key] = (1 + 0.2 * u if norm_scale else 0.3 * u).to(value.dtype)
    return out


def write_checkpoint(main, models_gridpe, utils) -> argparse.Namespace:
    """What ``main.py`` saves as ``best_checkpoint.pth`` after its first epoch, for the tiny model."""
    from timm.optim import create_optimizer
    from timm.scheduler import create_scheduler
    from timm.utils import ModelEma, NativeScaler, get_state_dict

    args = main.get_args_parser().parse_args(FLAGS)
    utils.init_distributed_mode(args)
    args.nb_classes = TINY["num_classes"]  # main.py: build_dataset's class count
    torch.manual_seed(args.seed + utils.get_rank())
    model = tiny_model(models_gridpe, args.input_size, args.num_heads)
    optimizer = create_optimizer(args, model)
    lr_scheduler, _ = create_scheduler(args, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler: CUDA is not available, so it is disabled
        loss_scaler = NativeScaler()
    # One step on noise, so that the optimizer's state holds tensors as after an epoch.
    model(torch.randn(2, 3, args.input_size, args.input_size)).logsumexp(-1).mean().backward()
    optimizer.step()
    lr_scheduler.step(0)
    model.load_state_dict(seeded(model.state_dict(), ""))
    model_ema = ModelEma(model, decay=args.model_ema_decay, device="", resume="")
    model_ema.ema.load_state_dict(seeded(model_ema.ema.state_dict(), "ema."))
    CHECKPOINT.parent.mkdir(exist_ok=True)
    utils.save_on_master(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "epoch": 0,
            "model_ema": get_state_dict(model_ema),
            "scaler": loss_scaler.state_dict(),
            "args": args,
        },
        CHECKPOINT,
    )
    return args


def official_outputs(models_gridpe, args: argparse.Namespace) -> dict[str, dict[str, list]]:
    """Logits of the saved weights at each size, read back as ``main.py --finetune`` reads them."""
    checkpoint = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)  # main.py allows Namespace globally
    outputs = {}
    for weights in ("model", "model_ema"):
        outputs[weights] = {}
        for resolution in RESOLUTIONS:
            model = tiny_model(models_gridpe, resolution if resolution[0] != resolution[1] else resolution[0], args.num_heads)
            model.load_state_dict(checkpoint[weights])  # strict: every key is the official model's
            with torch.no_grad():
                outputs[weights][tag(resolution)] = model.eval()(probe_images(resolution)).tolist()
    return outputs


def eval_transform(datasets, args: argparse.Namespace) -> dict:
    """The settings of ``datasets.build_transform(is_train=False, args)``."""
    steps = {type(t).__name__: t for t in datasets.build_transform(False, args).transforms}
    resize, crop, normalize = steps.get("Resize"), steps.get("CenterCrop"), steps["Normalize"]
    return dict(
        resize=resize.size if resize else None,
        interpolation=resize.interpolation.value if resize else None,
        crop=list(crop.size) if crop else None,
        mean=list(normalize.mean),
        std=list(normalize.std),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="a checkout of BoyangL1/Gridpe")
    repo = parser.parse_args().repo.resolve()
    official_main, models_gridpe, utils, datasets = import_official(repo)
    args = write_checkpoint(official_main, models_gridpe, utils)
    import timm

    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    data = dict(
        repository="BoyangL1/Gridpe",
        commit=commit or None,
        timm=timm.__version__,
        torch=torch.__version__,
        checkpoint=CHECKPOINT.name,
        resolutions=[list(r) for r in RESOLUTIONS],
        eval_transform=eval_transform(datasets, args),
        outputs=official_outputs(models_gridpe, args),
    )
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {CHECKPOINT} ({CHECKPOINT.stat().st_size} bytes) and {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

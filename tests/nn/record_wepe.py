"""The WePE authors' own ViT-Ti, recorded for ``tests/nn/test_from_wepe.py`` (``deploykit import wepe``).

Builds the official ``ImprovedViT_Ti`` from a checkout of
``github.com/1131230221/Weierstrass-Elliptic-Function-Positional-Encoding`` (``W_Ti.py``) at a tiny
seeded size, gives every parameter a seeded value a trained model could hold (initial LayerNorms
and zero biases would hide a wrong mapping), saves ``model.state_dict()`` with ``torch.save``
exactly as ``W_Ti.py`` saves ``best_wef_vit_ti.pth``, and runs the official forward (eval mode) on
hashed inputs (``timm_reference.hashed_uniform``). Written to ``tests/nn/data/wepe/``:

* ``best_wef_vit_ti.pth``: the checkpoint.
* ``clamped.pth``: the same model with ``alpha_learn = -5``, so ``softplus`` gives ω3′ = 0.0067
  and the official clamp holds it at 0.02.
* ``reference.json``: the sizes, and per file the official logits, the tanh-squashed features the
  official projection reads (``squashed``) and the official truncated ℘, ℘′ at the patch centres
  (``wp``, float64), so the test can tell the ℘ difference from everything else.

Recorded from the repository at commit 3c27aecdfd06 (2025-09-09); ``reference.json`` keeps the
sha256 of the ``W_Ti.py`` it ran. The tests read only these files. Regenerate, in an environment with the official code's needs
(PyTorch, NumPy; ``torchvision`` is imported by ``W_Ti.py`` for its CIFAR loaders only)::

    python tests/nn/record_wepe.py --repo PATH_TO_CHECKOUT
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import torch
from timm_reference import hashed_uniform

OUT = Path(__file__).with_name("data") / "wepe"
# ImprovedViT_Ti's arguments: a small model whose heads (4) and image size (64) differ from the
# script's defaults (3, 224), so the test shows that the importer's assumptions reach the model.
MODEL = dict(img_size=64, patch_size=8, in_channels=3, num_classes=10, embed_dim=32, depth=2, num_heads=4, mlp_ratio=3.0)
# Trained-looking values of the encoding's scalars: α_scale 0.3, ω3′ = softplus(0.5) = 0.974, β_pos 1.1.
ENCODING_SCALARS = {"log_alpha_scale": math.log(0.3), "alpha_learn": 0.5, "pos_scale": 1.1}
CLAMPED_ALPHA_LEARN = -5.0
IMAGES = dict(key="wepe-images", batch=2, scale=1.7)
SEED = 0


def images() -> torch.Tensor:
    """``[2, 3, 64, 64]`` float32 inputs, a pure function of ``IMAGES`` (any machine, any torch)."""
    shape = (IMAGES["batch"], MODEL["in_channels"], MODEL["img_size"], MODEL["img_size"])
    return (hashed_uniform(shape, IMAGES["key"]) * IMAGES["scale"]).float()


def load_official(repo: Path) -> types.ModuleType:
    """``W_Ti.py`` as a module. Its top-level ``import torchvision`` serves only its CIFAR loaders;
    where torchvision does not import (PyPI's build for a CPU torch), an empty module stands in."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # a CUDA torchvision beside a CPU torch fails in its operator registration
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = types.ModuleType("torchvision")
        sys.modules["torchvision.transforms"] = sys.modules["torchvision"].transforms = types.ModuleType("torchvision.transforms")
    spec = importlib.util.spec_from_file_location("W_Ti", repo / "W_Ti.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seeded_model(official: types.ModuleType) -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = official.ImprovedViT_Ti(**MODEL).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rpartition(".")[2]
            if leaf in ENCODING_SCALARS:
                param.fill_(ENCODING_SCALARS[leaf])
            elif param.ndim == 1 and leaf == "weight":  # LayerNorm scales
                param.copy_(1 + 0.2 * (torch.rand_like(param) * 2 - 1))
            else:
                param.copy_(0.3 * (torch.rand_like(param) * 2 - 1))
    return model


def official_wp(model: torch.nn.Module) -> torch.Tensor:
    """The official ℘, ℘′ ``[N, 4]`` (Re℘, Im℘, Re℘′, Im℘′), float64, at the patch centres
    ``z = 0.4·(u·2ω1 + i·v·2ω3′)`` of ``W_Ti.py`` (row-major, ``u = (j + ½)/W``, ``v = (i + ½)/H``)."""
    enc = model.pos_encoding
    side = MODEL["img_size"] // MODEL["patch_size"]
    centres = (torch.arange(side, dtype=torch.float64) + 0.5) / side
    v, u = centres[:, None].expand(side, side).reshape(-1), centres[None, :].expand(side, side).reshape(-1)
    omega3 = float(torch.nn.functional.softplus(enc.alpha_learn.detach().double()).clamp(0.02, 8.0))
    z = torch.complex(u * 2 * enc.wef.omega1.real.item() * 0.4, v * 2 * omega3 * 0.4)
    wp, dwp = enc.wef.wp_and_wp_prime(z)
    return torch.stack([wp.real, wp.imag, dwp.real, dwp.imag], dim=-1)


def record(model: torch.nn.Module, path: Path) -> dict:
    """Save the state dict as ``W_Ti.py`` does and run the official forward on ``images()``."""
    torch.save(model.state_dict(), path)
    squashed = []
    hook = model.pos_encoding.projection.register_forward_pre_hook(lambda module, args: squashed.append(args[0]))
    with torch.no_grad():
        logits = model(images())
    hook.remove()
    return {"logits": logits.tolist(), "squashed": squashed[0].tolist(), "wp": official_wp(model).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="checkout of the official repository (holds W_Ti.py)")
    repo = parser.parse_args().repo
    official = load_official(repo)
    OUT.mkdir(parents=True, exist_ok=True)
    model = seeded_model(official)
    cases = {"best_wef_vit_ti.pth": record(model, OUT / "best_wef_vit_ti.pth")}
    with torch.no_grad():
        model.pos_encoding.alpha_learn.fill_(CLAMPED_ALPHA_LEARN)
    cases["clamped.pth"] = record(model, OUT / "clamped.pth")
    reference = {
        "W_Ti.py sha256": hashlib.sha256((repo / "W_Ti.py").read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "model": MODEL,
        "images": IMAGES,
        "cases": cases,
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {', '.join(sorted(cases))} and reference.json to {OUT}")


if __name__ == "__main__":
    main()

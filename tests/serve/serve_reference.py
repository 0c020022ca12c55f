"""Independent oracles for the serving tests: ONNX Runtime called directly (no deploykit
runner), preprocessing with PyTorch's antialiased bicubic resize (what validation used before
``deploykit.inputs.imaging``) and a float64 softmax / top-k, written out here, not taken from the code
under test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def ort_logits(export_dir: Path, images: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """``[B, 3, h, w]`` float32 through the exported graph of ``precision`` at ``(h, w)``, by ONNX
    Runtime on the CPU as deploykit's runner runs it (int8 weights in 7 bits where int8 saturates)."""
    from deploykit.runners.onnxrt import CPU, OnnxrtRunner

    manifest = json.loads((export_dir / "manifest.json").read_text())
    (graph,) = [g for g in manifest["graphs"] if tuple(g["resolution"]) == images.shape[-2:] and g["precision"] == precision]
    with OnnxrtRunner(export_dir / graph["file"], providers=[CPU]) as runner:
        return runner.infer({"images": images})["logits"]


def torch_preprocess(
    image: np.ndarray, resolution, mean, std, crop_pct: float = 0.875, crop_mode: str = "center", interpolation: str = "bicubic"
) -> np.ndarray:
    """timm's eval transform (``transforms_imagenet_eval``: torchvision ``Resize`` / timm
    ``ResizeKeepRatio``, ``CenterCrop`` / ``CenterCropOrPad``) with ``F.interpolate(antialias=True)``
    in float64: ``[H, W, 3]`` (or ``[H, W]``) uint8 → ``[3, h, w]`` float32."""
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    h, w = resolution
    x = torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1)[None].double() / 255.0
    H, W = x.shape[-2:]
    scale_h, scale_w = math.floor(h / crop_pct), math.floor(w / crop_pct)
    if crop_mode == "squash":
        size = (scale_h, scale_w)
    elif crop_mode == "center" and scale_h == scale_w:  # torchvision Resize(int): short side to scale, long side truncated
        size = (scale_h, int(scale_h * W / H)) if H <= W else (int(scale_w * H / W), scale_w)
    else:  # timm ResizeKeepRatio: longest=1 for border, 0 for center
        ratio = max(H / scale_h, W / scale_w) if crop_mode == "border" else min(H / scale_h, W / scale_w)
        size = (round(H / ratio), round(W / ratio))
    x = F.interpolate(x, size=size, mode=interpolation, align_corners=False, antialias=True).clamp_(0, 1)
    fill = [round(255 * m) / 255 for m in mean] if crop_mode == "border" else [0.0, 0.0, 0.0]
    if h > size[0] or w > size[1]:  # CenterCrop pads first (left, top, right, bottom)
        pad = [max(w - size[1], 0) // 2, max(w - size[1] + 1, 0) // 2, max(h - size[0], 0) // 2, max(h - size[0] + 1, 0) // 2]
        x = torch.cat([F.pad(x[:, c : c + 1], pad, value=fill[c]) for c in range(3)], dim=1)
    top, left = int(round((x.shape[-2] - h) / 2.0)), int(round((x.shape[-1] - w) / 2.0))
    x = x[..., top : top + h, left : left + w]
    x = (x - torch.tensor(mean, dtype=x.dtype)[:, None, None]) / torch.tensor(std, dtype=x.dtype)[:, None, None]
    return x[0].float().numpy()


def preprocessed(export_dir: Path, image: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
    """``torch_preprocess`` with the settings the export's ``config.json`` records (timm's defaults where absent)."""
    config = json.loads((export_dir / "config.json").read_text())
    settings = {k: config[k] for k in ("crop_pct", "crop_mode", "interpolation") if k in config}
    return torch_preprocess(image, resolution, config["mean"], config["std"], **settings)


def softmax_top_k(logits: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the k (class, probability) pairs with the highest probability, best first."""
    rows = []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        rows.append(sorted(enumerate(p.tolist()), key=lambda cp: (-cp[1], cp[0]))[:k])
    return rows


def zoo_test_images(count: int, size: int, offset: int = 0) -> list[np.ndarray]:
    """``count`` images of the zoo dataset's test split rendered at ``size`` px, as ``[H, W, 3]`` uint8."""
    from deploykit.inputs.datasets import get_dataset

    pixels = get_dataset("shape-relations").images("test", range(offset, offset + count), size)
    return [np.ascontiguousarray((p.transpose(1, 2, 0) * 255).round().astype(np.uint8)) for p in pixels]


def png(image: np.ndarray) -> bytes:
    """Lossless PNG bytes of a ``[H, W, 3]`` uint8 image."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()

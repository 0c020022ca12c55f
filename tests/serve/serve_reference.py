"""Independent oracles for the serving tests: ONNX Runtime called directly (no deploykit
runner), preprocessing with PyTorch's antialiased bicubic resize (what validation used before
``deploykit.imaging``) and a float64 softmax / top-k, written out here, not taken from the code
under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F


def ort_logits(export_dir: Path, images: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """``[B, 3, h, w]`` float32 through the exported graph of ``precision`` at ``(h, w)``, by ONNX Runtime."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    (graph,) = [g for g in manifest["graphs"] if tuple(g["resolution"]) == images.shape[-2:] and g["precision"] == precision]
    session = ort.InferenceSession(str(export_dir / graph["file"]), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"images": images})[0]


def torch_preprocess(image: np.ndarray, resolution, mean, std, crop_pct: float = 0.875) -> np.ndarray:
    """timm's eval transform with ``F.interpolate(bicubic, antialias=True)`` in float64:
    ``[H, W, 3]`` (or ``[H, W]``) uint8 → ``[3, h, w]`` float32."""
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    h, w = resolution
    x = torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1)[None].double() / 255.0
    scale = max(h, w) / crop_pct / min(x.shape[-2:])
    size = (max(h, round(x.shape[-2] * scale)), max(w, round(x.shape[-1] * scale)))
    x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp_(0, 1)
    top, left = (size[0] - h) // 2, (size[1] - w) // 2
    x = x[..., top : top + h, left : left + w]
    x = (x - torch.tensor(mean, dtype=x.dtype)[:, None, None]) / torch.tensor(std, dtype=x.dtype)[:, None, None]
    return x[0].float().numpy()


def preprocessed(export_dir: Path, image: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
    config = json.loads((export_dir / "config.json").read_text())
    return torch_preprocess(image, resolution, config["mean"], config["std"])


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
    from deploykit.zoo.dataset import get_dataset

    pixels = get_dataset("shape-relations").images("test", range(offset, offset + count), size)
    return [np.ascontiguousarray((p.transpose(1, 2, 0) * 255).round().astype(np.uint8)) for p in pixels]


def png(image: np.ndarray) -> bytes:
    """Lossless PNG bytes of a ``[H, W, 3]`` uint8 image."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()

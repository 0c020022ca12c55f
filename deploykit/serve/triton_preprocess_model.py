"""Triton Python-backend model: encoded image bytes → one preprocessed ``[3, H, W]`` float32.

Copied verbatim into a generated model repository as ``preprocess_<res>/1/model.py``, so it
depends only on numpy and Pillow (no deploykit, no torch) and reads its settings from the
``parameters`` of its ``config.pbtxt``: ``height``, ``width``, ``mean``, ``std``, ``crop_pct``.
It mirrors ``deploykit.data.preprocess`` (short side to ``max(h, w) / crop_pct`` with an
antialiased bicubic resize, centre crop, ``(x / 255 - mean) / std``); Pillow's bicubic filter
differs from torch's in the last bits, so the served logits agree with the in-process pipeline
to resize precision, not bit for bit.
"""

from __future__ import annotations

import io
import json

import numpy as np


def preprocess_bytes(data: bytes, height: int, width: int, mean, std, crop_pct: float) -> np.ndarray:
    """Decode, resize the short side, centre-crop and normalise one image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
    scale = max(height, width) / crop_pct / min(img.height, img.width)
    size_hw = (max(height, round(img.height * scale)), max(width, round(img.width * scale)))
    img = img.resize((size_hw[1], size_hw[0]), Image.Resampling.BICUBIC)
    top, left = (size_hw[0] - height) // 2, (size_hw[1] - width) // 2
    x = np.asarray(img, dtype=np.float64)[top : top + height, left : left + width] / 255.0
    x = (x - np.asarray(mean)) / np.asarray(std)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


class TritonPythonModel:
    """The Python backend's entry point (``initialize`` / ``execute``)."""

    def initialize(self, args: dict) -> None:
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.height, self.width = int(params["height"]), int(params["width"])
        self.mean, self.std = json.loads(params["mean"]), json.loads(params["std"])
        self.crop_pct = float(params["crop_pct"])

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

        responses = []
        for request in requests:  # one bad request fails alone, not the whole batch
            try:
                items = pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)
                images = np.stack([preprocess_bytes(bytes(b), self.height, self.width, self.mean, self.std, self.crop_pct) for b in items])
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("images", images)]))
            except (OSError, ValueError) as err:
                message = f"cannot decode image bytes: {err}"
                code = getattr(pb_utils.TritonError, "INVALID_ARG", None)  # error codes: Triton >= 23.11
                error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

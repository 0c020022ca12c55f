"""Triton Python-backend model: encoded image bytes → one preprocessed ``[3, H, W]`` float32.

Copied verbatim into a generated model repository as ``preprocess_<res>/1/model.py``, beside
``deploykit_imaging.py`` (a copy of ``deploykit/inputs/imaging.py``), so it needs numpy and Pillow
only, and preprocesses with the code the in-process pipeline and validation use: the served
tensors equal ``deploykit.inputs.imaging.Preprocessing`` to float32 rounding. Settings come from the
``parameters`` of its ``config.pbtxt``: ``height``, ``width``, ``preprocessing`` (the model's, as
``config.json`` records it), ``max_pixels``, ``max_bytes``, ``max_request_pixels``. An image that is
not one, or is over a limit (size and decode work, checked from its header before decoding; its
request's images' pixels in all), gets INVALID_ARGUMENT with
one line; so does a request that fails in any other way, with its exception's type only (no path,
no traceback: that goes to Triton's log). The other requests are answered.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np


class TritonPythonModel:
    """The Python backend's entry point (``initialize`` / ``execute``)."""

    def initialize(self, args: dict) -> None:
        import deploykit_imaging  # beside this file: the Python backend puts the version directory on sys.path

        self.imaging = deploykit_imaging
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.resolution = int(params["height"]), int(params["width"])
        self.preprocessing = self.imaging.Preprocessing(**json.loads(params["preprocessing"]))
        self.max_pixels, self.max_bytes = int(params["max_pixels"]), int(params["max_bytes"])
        self.max_request_pixels = int(params["max_request_pixels"])

    def _preprocess(self, data: bytes) -> np.ndarray:
        image = self.imaging.decode(data, self.max_pixels, self.max_bytes)
        return self.preprocessing(image, self.resolution)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

        responses = []
        for request in requests:  # one bad request fails alone, not the whole batch
            try:
                items = pb_utils.get_input_tensor_by_name(request, self.imaging.ENCODED_INPUT).as_numpy().reshape(-1)
                self.imaging.check_request_pixels(items, self.max_request_pixels)
                images = np.stack([self._preprocess(bytes(b)) for b in items])
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("images", images)]))
            except Exception as err:
                if isinstance(err, self.imaging.ImageRejected):
                    message = str(err)
                else:  # not one of ours: its message may hold paths, so the client sees its type only
                    traceback.print_exception(err, file=sys.stderr)  # the stub's stderr is Triton's log
                    message = f"cannot preprocess this request's images ({type(err).__name__})"
                error = pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

"""Triton Python-backend model ``classify`` of ``deploykit serve``: encoded images → top-k classes.

Written into the server's model repository as ``classify/1/model.py``, beside
``deploykit_imaging.py`` (a copy of ``deploykit/inputs/imaging.py``: the pipeline's decoding, routing
and preprocessing, so served and in-process answers come from the same pixels). Settings come
from the ``settings`` JSON parameter of ``config.pbtxt`` (written by ``classify_config``).

Per request: its images' pixels in all are read from their headers and bounded (``max_request_pixels``:
a batch is answered once its every image is prepared, so one request's decode work is what its
batch-mates may wait for), then every image's size and decode work are checked against the
limits, and it is decoded, routed to the nearest exported resolution and preprocessed. The images
of a batch are prepared in parallel, on a pool of threads (Pillow's decoders and resizes release the
GIL), taken in turns across requests (every request's first image before any request's second),
so a valid image does not wait behind the decode of a worst-case one, or of another request's many. Any
failure there is that request's alone: INVALID_ARGUMENT (HTTP 400) with one line and no
traceback or path (an ``ImageRejected`` says why; anything else names its exception type, and its
traceback goes to Triton's log); the other requests of the same batch are answered. The images
of all requests routed to one resolution go to ``logits_<res>`` in one call (Triton's BLS), whose
dynamic batcher merges them with other clients'; a call that fails (the model answered NaN/Inf,
which is never ranked) fails the requests whose images it carried, with its error's last line.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

DECODE_THREADS = 4


class TritonPythonModel:
    """The Python backend's entry point (``initialize`` / ``execute``)."""

    def initialize(self, args: dict) -> None:
        import deploykit_imaging  # beside this file: the Python backend puts the version directory on sys.path
        import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

        self.pb, self.imaging = pb_utils, deploykit_imaging
        settings = json.loads(json.loads(args["model_config"])["parameters"]["settings"]["string_value"])
        self.resolutions = [tuple(r) for r in settings["resolutions"]]
        self.models = dict(zip(self.resolutions, settings["models"]))
        self.preprocessing = self.imaging.Preprocessing(**settings["preprocessing"])
        self.limits = [settings[k] for k in ("max_pixels", "max_bytes", "max_side", "max_aspect")]
        self.max_batch_size = settings["max_batch_size"]
        self.max_request_pixels = settings["max_request_pixels"]
        # decoding threads: one per core, and at least a few, so that a worst-case image does not hold
        # the others even on one core (the OS shares it between them); no more than a batch holds
        threads = min(self.max_batch_size, max(DECODE_THREADS, os.cpu_count() or 1))
        self.decoders = ThreadPoolExecutor(threads, thread_name_prefix="classify-decode")

    def finalize(self) -> None:
        self.decoders.shutdown(wait=False, cancel_futures=True)

    def execute(self, requests):
        errors, taken = {}, []  # request index -> TritonError; (request, its encoded images)
        for i, request in enumerate(requests):
            try:
                items = self._items(request)
                self.imaging.check_request_pixels(items, self.max_request_pixels)
                taken.append((i, items))
            except Exception as err:  # a request without its images, or with too many pixels, fails alone
                errors[i] = self._rejected(err)
        futures = {i: [] for i, _ in taken}
        for j in range(max((len(items) for _, items in taken), default=0)):  # in turns across requests
            for i, items in taken:
                if j < len(items):
                    futures[i].append(self.decoders.submit(self._prepare, items[j]))
        pending = list(futures.items())
        images, counts = [], [0] * len(requests)  # (request, item, resolution, [3, h, w])
        for i, futures in pending:
            try:
                prepared = [(i, j, *future.result()) for j, future in enumerate(futures)]
            except Exception as err:  # whatever went wrong with this request's images, it fails alone
                errors[i], prepared = self._rejected(err), []
            images += prepared
            counts[i] = len(prepared)
        results = self._classify(images, errors)
        return [self._response(i, counts[i], results, errors) for i in range(len(requests))]

    def _rejected(self, err: Exception):
        """The INVALID_ARGUMENT error of one request whose images could not be prepared."""
        if isinstance(err, self.imaging.ImageRejected):
            message = str(err)
        else:  # not one of ours: its message may hold paths, so the client sees its type only
            traceback.print_exception(err, file=sys.stderr)  # the stub's stderr is Triton's log
            message = f"cannot prepare this request's images ({type(err).__name__})"
        return self.pb.TritonError(message, self.pb.TritonError.INVALID_ARG)

    def _items(self, request) -> np.ndarray:
        items = self.pb.get_input_tensor_by_name(request, self.imaging.ENCODED_INPUT).as_numpy().reshape(-1)
        if len(items) == 0:
            raise self.imaging.ImageRejected("empty batch: send at least one image")
        return items

    def _prepare(self, data: bytes) -> tuple[tuple[int, int], np.ndarray]:
        image = self.imaging.decode(bytes(data), *self.limits)
        res = self.imaging.nearest_resolution(image.shape[:2], self.resolutions)
        return res, self.preprocessing(image, res)

    def _classify(self, images: list, errors: dict) -> dict:
        """``(request, item) -> (classes, scores, resolution)``; a failed call marks its requests in ``errors``."""
        results = {}
        for res in dict.fromkeys(r for _, _, r, _ in images):
            routed = [entry for entry in images if entry[2] == res and entry[0] not in errors]
            for start in range(0, len(routed), self.max_batch_size):
                chunk = routed[start : start + self.max_batch_size]
                try:
                    response = self.pb.InferenceRequest(
                        model_name=self.models[res],
                        inputs=[self.pb.Tensor("images", np.stack([x for *_, x in chunk]))],
                        requested_output_names=["classes", "scores"],
                    ).exec()
                    failure = _last_line(response.error().message()) if response.has_error() else None
                except Exception as err:  # a failed call fails its own requests, not the whole batch
                    failure = type(err).__name__
                if failure is not None:  # a server-side fault: one line
                    errors.update({i: self.pb.TritonError(f"{self.models[res]} failed: {failure}") for i, *_ in chunk})
                    continue
                classes = self.pb.get_output_tensor_by_name(response, "classes").as_numpy()
                scores = self.pb.get_output_tensor_by_name(response, "scores").as_numpy()
                for row, (i, j, _, _) in enumerate(chunk):
                    results[i, j] = classes[row], scores[row], np.array(res, np.int64)
        return results

    def _response(self, i: int, count: int, results: dict, errors: dict):
        if i in errors:
            return self.pb.InferenceResponse(error=errors[i])
        rows = [results[i, j] for j in range(count)]
        names = ("classes", "scores", "resolution")
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(n, np.stack([r[k] for r in rows])) for k, n in enumerate(names)])


def _last_line(message: str) -> str:
    """What a failed ``logits_<res>`` call says: PyTriton answers a Python traceback, whose last
    line is ``module.ExceptionType: message``; the message alone."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "no message"
    name, colon, rest = last.partition(": ")
    return rest if colon and name.replace(".", "").replace("_", "").isalnum() else last

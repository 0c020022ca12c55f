"""Triton Python-backend model ``classify`` of ``deploykit serve``: encoded images → top-k classes.

Written into the server's model repository as ``classify/1/model.py``, beside
``deploykit_imaging.py`` (a copy of ``deploykit/inputs/imaging.py``: the pipeline's decoding, routing
and preprocessing, so served and in-process answers come from the same pixels). Settings come
from the ``settings`` JSON parameter of ``config.pbtxt`` (written by ``classify_config``).

Per request: its images' pixels in all are read from their headers and bounded (``max_request_pixels``),
then every image's size and decode work are checked against the limits, and it is decoded,
routed to the nearest exported resolution and preprocessed. Each request is answered on its own,
through its response sender, as soon as its own images are classified: ``execute`` only hands
the requests to the decode threads and returns, so the instance takes the next requests while
earlier ones decode, and a request never waits for a batch-mate's images (issue 52, item 3: a
valid request batched with one of 32 worst-case images waited 194 s). The decode threads take
the images in turns across every request in flight (``Turns``: each request's next image, one
request after another), so a request waits behind at most one image of each other request, whatever
their image counts. Pillow's decoders and resizes release the GIL. Any failure there is that
request's alone: INVALID_ARGUMENT (HTTP 400) with one line and no traceback or path (an
``ImageRejected`` says why; anything else names its exception type, and its traceback goes to
Triton's log). One answering thread takes every request whose images are ready and sends the
images routed to one resolution to ``logits_<res>`` in one call (Triton's BLS), whose dynamic
batcher merges them with other clients'; a call that fails (the model answered NaN/Inf, which is
never ranked) fails the requests whose images it carried, with its error's last line.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from functools import partial

import numpy as np

DECODE_THREADS = 4


class _Request:
    """One request's images on their way through ``Turns``: each prepared at most once, and
    ``done`` called once, with every result or with the first failure."""

    def __init__(self, items, prepare: Callable, done: Callable):
        self.items, self.prepare, self.done = items, prepare, done
        self.taken = 0  # images handed to a thread (under the Turns lock)
        self.results = [None] * len(items)
        self.left, self.failed, self.lock = len(items), False, threading.Lock()

    def run(self, index: int) -> None:
        if self.failed:  # an earlier image failed the request: the rest are not decoded
            return
        try:
            result = self.prepare(self.items[index])
        except Exception as err:  # whatever went wrong with this request's images, it fails alone
            with self.lock:
                first, self.failed = not self.failed, True
            if first:
                self.done(None, err)
            return
        with self.lock:
            if self.failed:
                return
            self.results[index], self.left = result, self.left - 1
            finished = self.left == 0
        if finished:
            self.done(self.results, None)


class Turns:
    """A few threads preparing the images of every request in flight, in turns: a thread takes
    the next image of the request at the head of the line, which then goes to the back while it
    has images left. A request just arrived waits behind at most one image of each request
    ahead of it, not behind their every image."""

    def __init__(self, threads: int, name: str = "classify-decode"):
        self._line: collections.deque[_Request] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self.threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def submit(self, items, prepare: Callable, done: Callable) -> None:
        """Prepare every item of one request with ``prepare``; then ``done(results, None)``, or
        ``done(None, error)`` at the first that raises."""
        with self._ready:
            self._line.append(_Request(items, prepare, done))
            self._ready.notify()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._line and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                request = self._line.popleft()
                index, request.taken = request.taken, request.taken + 1
                if request.taken < len(request.items):
                    self._line.append(request)
            request.run(index)

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._line.clear()
            self._ready.notify_all()


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
        self.decoders = Turns(threads)
        self.ready: queue.SimpleQueue = queue.SimpleQueue()  # (sender, prepared images or None, error or None)
        self.answering = threading.Thread(target=self._answer_ready, name="classify-answer", daemon=True)
        self.answering.start()

    def finalize(self) -> None:
        self.decoders.close()
        self.ready.put(None)

    def execute(self, requests):
        """Hand each request's images to the decode threads and return: every request is answered
        through its own response sender (module docstring)."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                items = self._items(request)
                self.imaging.check_request_pixels(items, self.max_request_pixels)
            except Exception as err:  # a request without its images, or with too many pixels, fails alone
                self._send(sender, self.pb.InferenceResponse(error=self._rejected(err)))
                continue
            self.decoders.submit(items, self._prepare, partial(self._prepared, sender))
        return None

    def _prepared(self, sender, images, error) -> None:
        self.ready.put((sender, images, error))

    def _answer_ready(self) -> None:
        """Answer the requests whose images are ready, all of those ready at once in one pass."""
        while True:
            taken = [self.ready.get()]
            while True:
                try:
                    taken.append(self.ready.get_nowait())
                except queue.Empty:
                    break
            done = None in taken
            try:
                self._answer([entry for entry in taken if entry is not None])
            except Exception as err:  # a fault of this model: the requests fail, the thread goes on
                traceback.print_exception(err, file=sys.stderr)
            if done:
                return

    def _answer(self, ready: list) -> None:
        errors, images, counts = {}, [], [0] * len(ready)  # request index -> TritonError; (request, item, resolution, [3, h, w])
        for i, (_, prepared, error) in enumerate(ready):
            if error is not None:
                errors[i] = self._rejected(error)
                continue
            images += [(i, j, *entry) for j, entry in enumerate(prepared)]
            counts[i] = len(prepared)
        try:
            results = self._classify(images, errors)
        except Exception as err:  # not a failed call (those are each request's): every request here fails
            traceback.print_exception(err, file=sys.stderr)
            failure = self.pb.TritonError(f"cannot classify this request's images ({type(err).__name__})")
            errors.update({i: failure for i in range(len(ready))})
            results = {}
        for i, (sender, _, _) in enumerate(ready):
            self._send(sender, self._response(i, counts[i], results, errors))

    def _send(self, sender, response) -> None:
        try:
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as err:  # the client went away, or Triton cancelled the request
            print(f"classify: a response could not be sent: {type(err).__name__}: {err}", file=sys.stderr)

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

"""Triton's Python backend, as far as deploykit's Python models use it, so a test can drive a
model's ``execute`` with a batch of requests in-process, as Triton's stub does: the
``triton_python_backend_utils`` module (tensors, requests, responses, errors) and BLS calls
(``InferenceRequest.exec``) answered by the ``logits_<res>`` infer functions ``deploykit serve``
binds through PyTriton, with PyTriton's error (a Python traceback) when one raises."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
import traceback
import types
from dataclasses import dataclass, field

import numpy as np

from deploykit.inputs import imaging


class TritonError:
    INVALID_ARG = "INVALID_ARG"
    INTERNAL = "INTERNAL"

    def __init__(self, message: str, code: str = INTERNAL):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


@dataclass
class Tensor:
    name: str
    array: np.ndarray

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list | None = None, error: TritonError | None = None):
        self.output_tensors, self._error = list(output_tensors or []), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


COMPLETE_FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL
_sent = itertools.count()  # the order responses are sent in, across every request


class ResponseSender:
    """A request's response sender, as Triton's stub gives a model that answers outside
    ``execute``'s return value: one response, with the final flag, once (the stub refuses more)."""

    def __init__(self):
        self.response, self.order, self._sent = None, None, threading.Event()

    def send(self, response=None, flags: int = 0) -> None:
        if self._sent.is_set():
            raise RuntimeError("Unable to send response. Non-decoupled model cannot send more than one response.")
        assert flags == COMPLETE_FINAL and response is not None, "a non-decoupled model sends its one response with the final flag"
        self.response, self.order = response, next(_sent)
        self._sent.set()

    def wait(self, timeout: float) -> InferenceResponse:
        if not self._sent.wait(timeout):
            raise TimeoutError(f"no response sent within {timeout} s")
        return self.response


@dataclass
class Request:
    """What Triton hands ``execute``: named input tensors, and the outputs the client asked for
    (none: Triton's stub reports none, and a model answers all)."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] = ()
    sender: ResponseSender = field(default_factory=ResponseSender)

    def requested_output_names(self) -> list[str]:
        return list(self.outputs)

    def get_response_sender(self) -> ResponseSender:
        return self.sender


def answered(model, requests: list[Request], timeout: float = 60) -> list[InferenceResponse]:
    """``model.execute(requests)``'s answers in request order: its return value, or (a model
    answering through the response senders, ``execute`` returning None) what each sender sent."""
    responses = model.execute(requests)
    if responses is not None:
        return responses
    return [request.sender.wait(timeout) for request in requests]


def images_request(*images: bytes) -> Request:
    """A ``classify`` / ``preprocess_<res>`` request: encoded images as a BYTES ``[B, 1]`` tensor."""
    return Request({"image": np.array([[data] for data in images], dtype=object)})


def _input(request: Request, name: str) -> Tensor | None:
    return Tensor(name, request.inputs[name]) if name in request.inputs else None


def _output(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors if t.name == name), None)


def utils_module(pipeline=None) -> types.ModuleType:
    """``triton_python_backend_utils``; BLS calls to ``logits_<res>`` run ``pipeline``'s models as
    ``deploykit serve`` binds them (``triton_server._logits_fn``, PyTriton's ``@batch`` included)."""
    from deploykit.serve.triton_server import _logits_fn, logits_model_name

    models = {logits_model_name(res): _logits_fn(pipeline) for res in (pipeline.resolutions if pipeline else [])}

    class InferenceRequest:
        def __init__(self, model_name: str, inputs: list, requested_output_names: list):
            self.model, self.inputs, self.outputs = model_name, inputs, requested_output_names

        def exec(self) -> InferenceResponse:
            from pytriton.proxy.types import Request as PyTritonRequest

            try:
                (answer,) = models[self.model]([PyTritonRequest(data={t.name: t.array for t in self.inputs})])
            except Exception as err:  # PyTriton answers any exception with its traceback
                return InferenceResponse(error=TritonError("".join(traceback.format_exception(err))))
            return InferenceResponse([Tensor(name, answer[name]) for name in self.outputs])

    module = types.ModuleType("triton_python_backend_utils")
    module.__dict__.update(
        TritonError=TritonError,
        Tensor=Tensor,
        InferenceResponse=InferenceResponse,
        InferenceRequest=InferenceRequest,
        get_input_tensor_by_name=_input,
        get_output_tensor_by_name=_output,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=COMPLETE_FINAL,
    )
    return module


def load_model(path, model_config: dict, monkeypatch, pipeline=None):
    """The Python model in ``path``, imported and initialized as Triton's stub does it:
    ``deploykit_imaging`` beside it, ``triton_python_backend_utils`` from the stub."""
    monkeypatch.setitem(sys.modules, "deploykit_imaging", imaging)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils_module(pipeline))
    spec = importlib.util.spec_from_file_location(f"python_model_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(model_config)})
    return model

"""Triton Python-backend model ``logits_<res>`` of ``deploykit serve``, for a CPU backend: the runner
lives in Triton's stub process, one per model instance.

Written into the server's model repository as ``logits_<res>/1/model.py``; its settings come from
the ``settings`` JSON parameter of ``config.pbtxt`` (written by ``triton_server.logits_config``):
the backend and graph the pipeline chose for this resolution, the streams of a runner that spreads a
batch over them (the instance's merged batch fills every core), else the threads each instance
computes on (the machine's cores split between the instances), ``top_k``.

A request reaches the runner straight from Triton's shared memory, without the hop PyTriton's
proxy adds to a bound function (into the serving process and back:
``benchmarks/results/serve_overhead.json``). Per batch of requests: a request whose pixels
cannot be classified (NaN/Inf, beyond ``±MAX_INPUT_MAGNITUDE``) gets INVALID_ARGUMENT with one
line; the others run in one call of the runner; a request whose rows the model answered with
NaN/Inf gets an error, as such an answer is never ranked; the rest get ``logits``, ``classes``
and ``scores``.
"""

from __future__ import annotations

import json

import numpy as np


class TritonPythonModel:
    """The Python backend's entry point (``initialize`` / ``execute``)."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # only exists inside Triton's stub

        from deploykit.answers import top_k, unranked
        from deploykit.backends.registry import create_runner
        from deploykit.catalog import IMAGES_INPUT, OUTPUT_NAME
        from deploykit.inputs import imaging

        self.pb, self.imaging, self.top_k, self.unranked = pb_utils, imaging, top_k, unranked
        self.input, self.output = IMAGES_INPUT, OUTPUT_NAME
        self.outputs = (OUTPUT_NAME, "classes", "scores")  # as config.pbtxt declares them
        settings = json.loads(json.loads(args["model_config"])["parameters"]["settings"]["string_value"])
        self.k, self.label = settings["top_k"], settings["label"]
        self.runner = create_runner(settings["backend"], settings["graph"], threads=settings["threads"], streams=settings["streams"])
        self.runner.activate()

    def finalize(self) -> None:
        self.runner.deactivate()

    def execute(self, requests):
        errors, images, answers = {}, {}, {}  # request index -> TritonError, its [n, 3, h, w] images, its outputs
        for i, request in enumerate(requests):
            x = self.pb.get_input_tensor_by_name(request, self.input).as_numpy()
            unusable = self.imaging.unusable_values(x)
            if unusable:
                errors[i] = self.pb.TritonError(unusable, self.pb.TritonError.INVALID_ARG)
            else:
                images[i] = x
        if images:
            batch = np.concatenate(list(images.values())) if len(images) > 1 else next(iter(images.values()))
            logits = self.runner.infer({self.input: batch})[self.output]
            classes, scores = self.top_k(logits, self.k)
            start = 0
            for i, x in images.items():
                rows = slice(start, start + len(x))
                start += len(x)
                fault = self.unranked(logits[rows], self.label)
                if fault:
                    errors[i] = self.pb.TritonError(fault)
                else:
                    answers[i] = (logits[rows], classes[rows], scores[rows])
        return [self._response(i, request, errors, answers) for i, request in enumerate(requests)]

    def _response(self, i: int, request, errors: dict, answers: dict):
        if i in errors:
            return self.pb.InferenceResponse(error=errors[i])
        # only the outputs the client asked for (Triton would drop the others after their copy
        # into shared memory); none named: all of them
        asked = set(request.requested_output_names()) or set(self.outputs)
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(n, a) for n, a in zip(self.outputs, answers[i]) if n in asked])

"""Stand-in runners over the real graph (ONNX Runtime, so answers can be compared): one detects
overlapping calls, what an engine with one execution context, one set of device buffers and one
stream must never see (it holds each call open for a moment, so two threads that are allowed in
at once do meet inside); one answers NaN for the first image of every call, as a model that
overflows would."""

from __future__ import annotations

import threading
import time

import numpy as np

from deploykit.runners.onnxrt import OnnxrtRunner

HOLD_S = 0.002


class OverlapDetectingRunner(OnnxrtRunner):
    """Counts calls that started while another call on this runner was still running."""

    name = "one-context"
    thread_safe = False  # like an engine context: one call at a time

    def __init__(self, model):
        super().__init__(model)
        self._guard = threading.Lock()  # protects the counters only, never the call
        self.inside = 0
        self.calls = 0
        self.overlaps = 0

    def _infer(self, feed):
        with self._guard:
            self.inside += 1
            self.calls += 1
            self.overlaps += self.inside > 1
        try:
            time.sleep(HOLD_S)
            return super()._infer(feed)
        finally:
            with self._guard:
                self.inside -= 1


class NanRowRunner(OnnxrtRunner):
    """The real graph's logits, but NaN for the first image of every call."""

    name = "nan-row"

    def _infer(self, feed):
        outputs = super()._infer(feed)
        for logits in outputs.values():
            logits[:1] = np.nan
        return outputs

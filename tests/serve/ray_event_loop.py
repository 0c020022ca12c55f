"""Run by ``test_ray_serve.py`` in its own process: does a replica's event loop stay free while
its pipeline computes? One replica whose first pipeline call holds until the replica has
received another request (or ``HOLD_S`` passes). While that call runs, the client keeps sending
requests: a replica that runs the pipeline on its event loop cannot receive any of them, so the
call gives up after ``HOLD_S``; one that runs it in a worker thread receives the next within
moments. Prints one JSON line.

Usage: python ray_event_loop.py EXPORT_DIR
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import ray
from ray import serve

from deploykit.serve.ray_serve import PipelineReplica, RayOptions

HOLD_S = 30.0


class HeldPipeline:
    """The replica's pipeline, whose first call waits for a request that arrives during it."""

    def __init__(self, pipeline, replica):
        self.pipeline, self.replica, self.limits = pipeline, replica, pipeline.limits
        self.first_call = None

    def __call__(self, images):
        if self.first_call is None:
            at_start, deadline = self.replica.received, time.monotonic() + HOLD_S
            while self.replica.received == at_start and time.monotonic() < deadline:
                time.sleep(0.01)
            self.first_call = {"received_during_call": self.replica.received > at_start}
        return self.pipeline(images)

    def describe_backends(self):
        return self.pipeline.describe_backends()


class ProbeReplica(PipelineReplica):
    def __init__(self, export_dir, options):
        super().__init__(export_dir, options)
        self.received = 0
        self.pipeline = HeldPipeline(self.pipeline, self)

    async def classify(self, image):
        self.received += 1  # runs on the replica's event loop, when the loop is free to run it
        return await super().classify(image)

    async def report(self) -> dict:
        return {"first_call": self.pipeline.first_call, "received": self.received}


def main(export_dir: str) -> dict:
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        options = RayOptions(num_replicas=1, max_batch_size=1, batch_wait_timeout_s=0.0, backend="ort", top_k=3)
        app = serve.deployment(ProbeReplica, name="probe", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=8).bind(
            export_dir, options
        )
        handle = serve.run(app, name="probe", route_prefix=None)
        image = np.zeros((32, 32, 3), np.uint8)
        start = time.monotonic()
        first, extra = handle.classify.remote(image), []
        while not _done(first) and time.monotonic() - start < HOLD_S + 30:
            extra.append(handle.classify.remote(image))
            time.sleep(0.2)
        answers = [first.result(timeout_s=120)] + [r.result(timeout_s=120) for r in extra]
        report = handle.report.remote().result(timeout_s=60)
    finally:
        serve.shutdown()
        ray.shutdown()
    return {**report, "answers": len(answers), "classes": [a["classes"] for a in answers[:2]]}


def _done(response) -> bool:
    try:
        response.result(timeout_s=0)
    except TimeoutError:
        return False
    return True


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)

"""One client cannot hurt another (issue 41): valid requests' latency and answers under a bounded
mixed load of every hostile kind, against ``deploykit serve`` on 127.0.0.1.

    python benchmarks/serve_hostile.py            # 400 valid requests a phase (hostile: at least 60 s), the worst accepted image at the limits
    python benchmarks/serve_hostile.py --quick    # smoke: 24 a phase, the worst image's builder at 1 MP

The zoo's default model (``models/shapes-ape``) is exported at its own resolution and served by
``deploykit serve`` with its defaults (``ServerProcess``: ONNX Runtime, free loopback ports). The
valid requests cycle through ``classify`` over HTTP and gRPC (PNGs of the zoo's test images at
four sizes) and ``logits_<res>`` over HTTP and gRPC (those images preprocessed), ``CONCURRENCY``
at once, each timed by ``perf_counter_ns`` around its client call. Two phases send the same list
(the hostile one, in full mode, again from the first until ``MIN_HOSTILE_S`` have passed):

quiet
    the valid requests alone (after an untimed warm-up);
hostile
    the same, while a process of its own (``hostile_load.py``, whose docstring lists the kinds)
    sends every hostile kind continuously: decode bombs the server refuses, the worst image it
    accepts, NaN and 3e38 tensors, compressed bodies, duplicate keys, non-ASCII header lengths,
    JSON over the value cap, slow-loris connections. Each kind is counted with its answers, from
    its first request (the phase starts once every kind has been answered once) to its last.

Every valid answer is compared with in-process inference (``deploykit.load(export_dir,
backend="ort")``, computed before the server starts): classes and routed resolution exactly,
scores and logits to ``rtol=1e-5, atol=1e-6`` (Triton's merged batches change a GEMM's row count,
which may change the last bits).

The bound, computed in the same run: under the hostile load every valid request's latency is at
most ``quiet p99 + K x T``, where

* ``T`` is the CPU time, in this process, of what ``classify`` does with the worst accepted
  image (``imaging.decode``, routing, preprocessing: ``triton_classify_model._prepare``), the
  median of three runs before the server starts;
* ``K`` is the server's ``classify`` instance count (``ServerOptions.classify_instances``, 2),
  which is also how many threads send that image, each with one in flight: at most K are in the
  server at once. ``classify`` answers each request as soon as its own images are classified, and
  its decode threads (at least 4 per instance) take the images of every request in flight in
  turns, so a valid request waits for no other request's image while a thread is free, and for
  at most one image of each request ahead of it when none is: at most K worst images, K x T.
  The one request of many worst images (``hostile_load.py``) is refused at full size (its pixels
  are over the per-request bound) and, in quick mode, takes its turns like any other.
  ``logits_<res>`` requests never pass through ``classify``: only CPU contention reaches them.

The memory bound, in the same run: the server's resident memory (``VmRSS`` summed over its
processes, sampled every ``RSS_INTERVAL_S`` through each phase; shared pages count once per
process, so the sum over-states) peaks under the hostile load at most ``quiet peak + B + D x M``,
where ``B`` is what the front may hold of request bytes (``--max-request-bytes`` times the bodies
held at once, plus as many incomplete gRPC messages: ``front_bytes``), ``D`` the decode threads of
every ``classify`` instance, and ``M`` what preparing the worst accepted image adds to a fresh
process's peak resident size (measured before the server starts).

The bound assumes a decoding instance keeps a core (this machine's usable cores are recorded):
where the cores are fewer than the instances plus the rest of the load, the decodes share them
and the bound may fail by contention rather than by anything a request makes the server do; the
result then names what took the time (the slowest valid requests, the worst image's answer
times). Writes ``benchmarks/results/serve-hostile.json`` (``-quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import io
import itertools
import math
import multiprocessing
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from decode_bounds import png_rgba16
from hostile_load import Clients, LoadSpec, run_load
from results_file import write_results

from deploykit.inputs import imaging
from deploykit.serve import defaults
from deploykit.serve.triton_classify_model import DECODE_THREADS

CONCURRENCY = 4
REQUESTS, QUICK_REQUESTS = 400, 24
MIN_HOSTILE_S = 60.0  # the hostile phase outlasts many worst-image decodes and slow-loris deadlines (full mode)
IMAGE_SIZES = (48, 40, 64, 30)  # the zoo's test images, rendered at these sizes
WORST_CASE = "png rgba16 paeth adam7"  # decode_bounds.py's worst accepted image
RTOL, ATOL = 1e-5, 1e-6
RSS_INTERVAL_S = 0.2
OUTPUTS = {"classify": ("classes", "scores", "resolution"), "logits": ("logits", "classes", "scores")}
EXACT = ("classes", "resolution")
SLOWEST = 8  # valid requests listed under the hostile load


@dataclass(frozen=True)
class ValidRequest:
    """One valid request: ``kind`` ``"classify"`` (``payload``: PNG bytes) or ``"logits"``
    (``payload``: ``[1, 3, h, w]`` float32) of test image number ``image``, sent over ``protocol``."""

    kind: str
    protocol: str
    image: int
    payload: bytes | np.ndarray

    @property
    def input(self) -> tuple[str, np.ndarray]:
        """The input's name and array."""
        if self.kind == "classify":
            return "image", np.array([[self.payload]], dtype=object)
        return "images", self.payload


@dataclass(frozen=True)
class Served:
    """One valid request's answer: its outcome label, latency and outputs (None when refused)."""

    outcome: str
    latency_ns: int
    outputs: dict[str, np.ndarray] | None


def export_zoo_model(work: Path) -> tuple[Path, tuple[int, int]]:
    """``models/shapes-ape`` exported at its own resolution into ``work/export``."""
    from deploykit.export import export
    from deploykit.zoo.resolve import resolve_model

    model, _ = resolve_model(encoding="ape")
    size = model.cfg.img_size
    res = (size, size) if isinstance(size, int) else tuple(size)
    export(model, [res], work / "export")
    return work / "export", res


def valid_requests(pipeline, count: int) -> list[ValidRequest]:
    """``count`` requests cycling classify/logits over HTTP/gRPC through the zoo's test images."""
    from PIL import Image

    from deploykit.inputs.datasets import get_dataset

    dataset, images = get_dataset("shape-relations"), []
    for size in IMAGE_SIZES:
        pixels = dataset.images("test", range(size, size + 4), size)
        images += [np.ascontiguousarray((p.transpose(1, 2, 0) * 255).round().astype(np.uint8)) for p in pixels]
    pngs, tensors = [], [pipeline.preprocess(image, pipeline.route(image.shape[:2]))[None] for image in images]
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    requests = []
    for i in range(count):
        n, protocol = (i // 4) % len(images), ("http", "grpc")[i % 2]
        requests.append(ValidRequest("classify", protocol, n, pngs[n]) if i % 4 < 2 else ValidRequest("logits", protocol, n, tensors[n]))
    return requests


def expected_answers(pipeline, requests: list[ValidRequest]) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """What in-process inference answers each ``(kind, image)`` (``OUTPUTS`` of its kind, batch of one)."""
    from deploykit.answers import top_k

    answers = {}
    for request in requests:
        key = request.kind, request.image
        if key in answers:
            continue
        if request.kind == "classify":
            p = pipeline(request.payload)
            answers[key] = {"classes": np.array([p.classes]), "scores": np.array([p.scores]), "resolution": np.array([p.resolution])}
        else:
            logits = pipeline.logits(request.payload)
            classes, scores = top_k(logits, pipeline.top_k)
            answers[key] = {"logits": logits, "classes": classes, "scores": scores}
    return answers


def equal(served: Served, expected: dict[str, np.ndarray]) -> bool:
    if served.outputs is None:
        return False
    for name, want in expected.items():
        got = served.outputs[name]
        same = np.array_equal(got, want) if name in EXACT else got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL)
        if not same:
            return False
    return True


def worst_prepare(pipeline, data: bytes, runs: int = 3) -> dict:
    """CPU seconds of ``classify``'s work on ``data`` in this process (decode, route, preprocess)."""
    decode_s, prepare_s = [], []
    for _ in range(runs):
        start = time.process_time()
        image = imaging.decode(data)
        decoded = time.process_time()
        pipeline.preprocess(image, pipeline.route(image.shape[:2]))
        decode_s.append(decoded - start)
        prepare_s.append(time.process_time() - start)
    return dict(
        case=WORST_CASE,
        bytes=len(data),
        height=image.shape[0],
        width=image.shape[1],
        decode_cpu_s=round(float(np.median(decode_s)), 3),
        prepare_cpu_s=round(float(np.median(prepare_s)), 3),
        prepare_cpu_s_runs=[round(s, 3) for s in prepare_s],
    )


def _prepare_peak(preprocessing, resolutions, data: bytes, results) -> None:
    """In a fresh process: its resident size before, and its peak after, preparing ``data`` as ``classify`` does (KiB)."""
    from PIL import Image

    from deploykit.inputs import imaging

    small = io.BytesIO()
    Image.new("RGB", (8, 8)).save(small, format="PNG")
    image = imaging.decode(small.getvalue())  # the decoders' and preprocessing's imports, before the measurement
    preprocessing(image, imaging.nearest_resolution(image.shape[:2], resolutions))
    with open("/proc/self/status") as status:  # resident now, not the imports' passing peak
        before = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    image = imaging.decode(data)
    preprocessing(image, imaging.nearest_resolution(image.shape[:2], resolutions))
    with open("/proc/self/status") as status:  # this process's own peak (ru_maxrss starts at its parent's)
        results.put((before, next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))))


def worst_prepare_bytes(pipeline, data: bytes) -> int:
    """``M`` of the memory bound: what preparing ``data`` adds to a fresh process's peak resident size."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_prepare_peak, args=(pipeline.config.preprocessing, pipeline.resolutions, data, results))
    child.start()
    before, after = results.get(timeout=300)
    child.join(60)
    return (after - before) * 1024  # /proc's sizes are in KiB


def rss_bytes(server_pid: int) -> dict[str, int]:
    """The server's resident memory by role (``_role``): ``VmRSS`` summed over its process tree."""
    roles: dict[str, int] = {}
    todo = [server_pid]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            todo += [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
        except OSError:
            continue  # exited meanwhile
        line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
        roles[_role(command)] = roles.get(_role(command), 0) + (int(line.split()[1]) * 1024 if line else 0)
    return roles


class RssPeak:
    """The peak of ``rss_bytes`` over a ``with`` block, sampled every ``RSS_INTERVAL_S``."""

    def __init__(self, server_pid: int):
        self.pid, self.peak, self.roles, self._stop = server_pid, 0, {}, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _note(self) -> None:
        roles = rss_bytes(self.pid)
        if sum(roles.values()) > self.peak:
            self.peak, self.roles = sum(roles.values()), roles

    def _sample(self) -> None:
        while True:
            self._note()
            if self._stop.wait(RSS_INTERVAL_S):
                return

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._note()


def run_phase(server, requests: list[ValidRequest], model: str, min_s: float = 0.0) -> list[Served]:
    """Send the requests in turn, ``CONCURRENCY`` at a time (each thread with its own clients),
    every one once and then, until ``min_s`` seconds have passed, again from the first."""
    count, answers, start = itertools.count(), {}, time.perf_counter()

    def send() -> None:
        clients = Clients(server.http, server.grpc)
        while (i := next(count)) < len(requests) or time.perf_counter() - start < min_s:
            request = requests[i % len(requests)]
            name, array = request.input
            sent = time.perf_counter_ns()
            outcome, result = clients.call(request.protocol, "classify" if request.kind == "classify" else model, name, array)
            latency = time.perf_counter_ns() - sent
            answers[i] = Served(outcome, latency, None if result is None else {n: result.as_numpy(n) for n in OUTPUTS[request.kind]})

    threads = [threading.Thread(target=send) for _ in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [answers[i] for i in range(len(answers))]


@dataclass(frozen=True)
class Phase:
    """One phase: the requests sent in order and their answers, the wall time, and the CPU
    seconds spent meanwhile by each of the server's processes (``cpu_seconds``), this client and
    the whole machine."""

    requests: list[ValidRequest]
    served: list[Served]
    wall_s: float
    cpu_s: dict[str, float]
    rss_peak: int
    rss_roles: dict[str, int]


def timed_phase(server, requests: list[ValidRequest], model: str, min_s: float = 0.0) -> Phase:
    before, start = cpu_seconds(server.proc.pid), time.perf_counter()
    with RssPeak(server.proc.pid) as rss:
        served = run_phase(server, requests, model, min_s)
    wall_s, after = time.perf_counter() - start, cpu_seconds(server.proc.pid)
    sent = [requests[i % len(requests)] for i in range(len(served))]
    return Phase(sent, served, wall_s, {role: round(after[role] - before.get(role, 0.0), 2) for role in after}, rss.peak, rss.roles)


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by the server's processes, by role, by this
    process (the valid client, during a phase) and by every core of the machine (``/proc/stat``)."""
    tick, seconds, todo = os.sysconf("SC_CLK_TCK"), {}, [server_pid]
    while todo:
        pid = todo.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            todo += [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
        except OSError:
            continue  # exited meanwhile
        role = _role(command)
        seconds[role] = seconds.get(role, 0.0) + (int(stat[11]) + int(stat[12])) / tick  # utime, stime
    seconds["benchmark client (valid requests)"] = time.process_time()
    busy = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    seconds["machine, all cores busy"] = (sum(busy) - busy[3] - busy[4]) / tick  # all but idle and iowait
    return seconds


def _role(command: str) -> str:
    if command.split(" ", 1)[0].endswith("tritonserver"):
        return "tritonserver"
    if "triton_python_backend_stub" in command:
        return "classify instances" if "/classify/" in command else "PyTriton's logits stubs"
    if "deploykit serve" in command:
        return "deploykit serve (front, PyTriton, ONNX Runtime)"
    return "PyTriton's logits stubs"  # the stubs' multiprocessing helpers


def latency_ms(samples_ns: list[int]) -> dict:
    from deploykit.profile.timing import LatencyStats

    stats = LatencyStats.from_ns(samples_ns)
    return {k: round(getattr(stats, f"{k}_ms"), 2) for k in ("p50", "p90", "p99", "max")}


def phase_summary(phase: Phase, expected: dict[tuple[str, int], dict]) -> dict:
    """Counts and latency of one phase, overall and per kind and protocol, and its CPU seconds."""
    requests, served = phase.requests, phase.served
    summary = dict(
        valid=len(served),
        answered=sum(s.outputs is not None for s in served),
        equal=sum(equal(s, expected[r.kind, r.image]) for r, s in zip(requests, served)),
        latency_ms=latency_ms([s.latency_ns for s in served]),
        wall_s=round(phase.wall_s, 1),
        throughput_rps=round(len(served) / phase.wall_s, 1),
        refused=sorted({s.outcome for s in served if s.outputs is None}),
        cpu_s=phase.cpu_s,
        rss_peak_mib=round(phase.rss_peak / 2**20, 1),
        rss_at_peak_mib={role: round(b / 2**20, 1) for role, b in sorted(phase.rss_roles.items())},
    )
    groups: dict[str, list[int]] = {}
    for request, s in zip(requests, served):
        groups.setdefault(f"{request.kind} {request.protocol}", []).append(s.latency_ns)
    summary["by_request"] = {group: latency_ms(samples) for group, samples in sorted(groups.items())}
    return summary


def hostile_phase(server, requests: list[ValidRequest], spec: LoadSpec, model: str, min_s: float) -> tuple[Phase, list[dict]]:
    """``timed_phase`` while ``run_load`` sends every hostile kind from a process of its own."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this one's threads or locks
    started, stop, results = context.Event(), context.Event(), context.Queue()
    load = context.Process(target=run_load, args=(spec, started, stop, results), daemon=True)
    load.start()
    try:
        if not started.wait(300):
            raise RuntimeError("the hostile load did not start within 300 s")
        phase = timed_phase(server, requests, model, min_s)
        stop.set()
        hostile = results.get(timeout=600)
    finally:
        stop.set()
        load.join(60)
    phase.cpu_s["hostile load process"] = round(hostile["cpu_s"], 2)
    return phase, hostile["kinds"]


def slowest(phase: Phase, count: int = SLOWEST) -> list[dict]:
    requests, served = phase.requests, phase.served
    order = sorted(range(len(served)), key=lambda i: -served[i].latency_ns)[:count]
    return [
        dict(index=i, request=f"{requests[i].kind} {requests[i].protocol}", latency_ms=round(served[i].latency_ns / 1e6, 1)) for i in order
    ]


def bound(quiet: dict, hostile: dict, worst: dict, instances: int) -> dict:
    """The stated bound (module docstring) and its verdict: every valid answer equal, and the
    hostile phase's slowest request within ``quiet p99 + K x T``."""
    limit_ms = quiet["latency_ms"]["p99"] + instances * worst["prepare_cpu_s"] * 1e3
    within = hostile["latency_ms"]["max"] <= limit_ms
    answers = hostile["equal"] == hostile["valid"] and quiet["equal"] == quiet["valid"]
    return dict(
        statement="every valid request's latency under the hostile load <= quiet p99 + K x T (K: classify instances, "
        "T: the worst accepted image's decode + preprocess CPU time in-process), and every valid answer equal to in-process inference",
        quiet_p99_ms=quiet["latency_ms"]["p99"],
        K=instances,
        T_ms=round(worst["prepare_cpu_s"] * 1e3, 1),
        bound_ms=round(limit_ms, 1),
        hostile_max_ms=hostile["latency_ms"]["max"],
        latency_within_bound=within,
        answers_equal=answers,
        met=within and answers,
    )


def memory_bound(quiet: dict, hostile: dict, worst_bytes: int, decoders: int, front_bytes: int) -> dict:
    """The memory bound (module docstring) and its verdict."""
    limit_mib = quiet["rss_peak_mib"] + (front_bytes + decoders * worst_bytes) / 2**20
    return dict(
        statement="the server's peak resident memory under the hostile load <= its quiet peak + B + D x M (B: request bytes "
        "the front may hold, D: classify's decode threads in all, M: the worst accepted image's preparation peak in a fresh process)",
        quiet_peak_mib=quiet["rss_peak_mib"],
        B_mib=round(front_bytes / 2**20, 1),
        D=decoders,
        M_mib=round(worst_bytes / 2**20, 1),
        bound_mib=round(limit_mib, 1),
        hostile_peak_mib=hostile["rss_peak_mib"],
        met=hostile["rss_peak_mib"] <= limit_mib,
    )


def serve_and_load(export_dir: Path, res: tuple[int, int], requests: list[ValidRequest], worst_bytes: bytes, quick: bool, work: Path):
    """Start the server, run both phases; ``(quiet, hostile, hostile kinds' records, server settings)``."""
    from deploykit.serve.bench import BenchOptions, ServerProcess
    from deploykit.serve.triton_server import ServerOptions, logits_model_name

    options, instances, model = BenchOptions(backend="ort"), ServerOptions().classify_instances, logits_model_name(res)
    server = ServerProcess(export_dir, options, work / "server.log")
    try:
        server.wait_ready()
        run_phase(server, requests[: 4 * CONCURRENCY], model)  # untimed: connections, thread pools and sessions settle
        quiet = timed_phase(server, requests, model)
        spec = LoadSpec(server.http, server.grpc, model, res, worst_bytes, worst_senders=instances, at_limits=not quick)
        hostile, records = hostile_phase(server, requests, spec, model, 0.0 if quick else MIN_HOSTILE_S)
    finally:
        server.stop()
    settings = dict(
        backend=options.backend,
        classify_instances=instances,
        max_batch_size=options.max_batch_size,
        max_queue_delay_us=options.max_queue_delay_us,
        header_timeout_s=defaults.HEADER_TIMEOUT_S,
        usable_cores=len(os.sched_getaffinity(0)),
        # classify's threads per instance (triton_classify_model.initialize), over its instances
        decode_threads=instances * min(options.max_batch_size, max(DECODE_THREADS, os.cpu_count() or 1)),
        # bodies held at once, and as many incomplete gRPC messages (the serving guide's table)
        front_bytes=2 * defaults.IN_FLIGHT_BODIES * defaults.MAX_REQUEST_BYTES,
    )
    return quiet, hostile, records, settings


def measure(quick: bool, count: int) -> dict:
    import torch

    import deploykit
    from deploykit.backends.environment import capture_environment, environment_line

    line = environment_line(capture_environment(torch.device("cpu")))
    with tempfile.TemporaryDirectory(prefix="serve_hostile_") as tmp:
        export_dir, res = export_zoo_model(Path(tmp))
        worst_bytes = png_rgba16(1000 if quick else math.isqrt(imaging.MAX_PIXELS), interlaced=True)
        with deploykit.load(export_dir, backend="ort", top_k=defaults.TOP_K) as pipeline:
            requests = valid_requests(pipeline, count)
            expected = expected_answers(pipeline, requests)
            worst = worst_prepare(pipeline, worst_bytes)
            worst_peak = worst_prepare_bytes(pipeline, worst_bytes)
        print(f"worst accepted image: {worst['width']}x{worst['height']}, {worst['prepare_cpu_s']} s CPU to prepare", flush=True)
        quiet_run, hostile_run, records, settings = serve_and_load(export_dir, res, requests, worst_bytes, quick, Path(tmp))
    quiet, hostile = phase_summary(quiet_run, expected), phase_summary(hostile_run, expected)
    verdict = bound(quiet, hostile, worst, settings["classify_instances"])
    memory = memory_bound(quiet, hostile, worst_peak, settings["decode_threads"], settings["front_bytes"])
    report(quiet, hostile, records, verdict, memory)
    return dict(
        environment_line=line,
        model=f"zoo:shapes-ape exported at {res[0]}x{res[1]}, fp32, served by deploykit serve (ONNX Runtime)",
        server=settings,
        load=dict(
            concurrency=CONCURRENCY,
            valid_requests_per_phase=count,
            valid_mix="classify http, classify grpc, logits http, logits grpc in turn; zoo test images at "
            + ", ".join(map(str, IMAGE_SIZES)),
            hostile="hostile_load.py: each kind by its own thread, 0.1 s after each answer; the worst accepted image by K threads, no pause",
        ),
        worst_accepted=worst,
        phases=dict(quiet=quiet, hostile=hostile),
        hostile_kinds=records,
        hostile_all_answered_as_expected=all(r["as_expected"] == r["sent"] for r in records if not r["kind"].startswith("slow")),
        slowest_under_hostile=slowest(hostile_run),
        bound=verdict,
        memory=memory,
    )


def report(quiet: dict, hostile: dict, records: list[dict], verdict: dict, memory: dict) -> None:
    for name, phase in (("quiet", quiet), ("hostile", hostile)):
        ms = phase["latency_ms"]
        print(f"{name:8} valid {phase['valid']}, equal {phase['equal']}; p50 {ms['p50']} ms, p99 {ms['p99']} ms, max {ms['max']} ms")
    for r in records:
        print(f"  {r['kind']:45} sent {r['sent']:5}  {r['outcomes']}")
    print(
        f"bound: max {verdict['hostile_max_ms']} ms <= {verdict['bound_ms']} ms (quiet p99 + {verdict['K']} x {verdict['T_ms']} ms): "
        f"{'met' if verdict['met'] else 'NOT met'}"
    )
    print(
        f"memory: peak {memory['hostile_peak_mib']} MiB <= {memory['bound_mib']} MiB (quiet {memory['quiet_peak_mib']} + "
        f"{memory['B_mib']} + {memory['D']} x {memory['M_mib']} MiB): {'met' if memory['met'] else 'NOT met'}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke: {QUICK_REQUESTS} requests a phase, the worst image's builder at 1 MP")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="valid requests a phase")
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    count = QUICK_REQUESTS if args.quick else args.requests
    write_results(__file__, argv, args.output_dir, args.quick, lambda: measure(args.quick, count))


if __name__ == "__main__":
    main()

"""GPU acceptance: everything about the engine path that CI (no GPU, no TensorRT) cannot check,
end to end, in one run, written to one JSON report that starts with the device line.

For every registered encoding (the zoo's trained model by default): export at two resolutions in
every precision plan ``deploykit.export.precision.PRECISIONS`` has; validate each plan in ONNX
Runtime (CPU, and CUDA where onnxruntime-gpu is installed, recording where each node ran);
build TensorRT and TensorRT-RTX engines with a batch profile and validate them at every profiled
shape; build the static-batch engines plain ``deploykit build`` makes and validate those; build
and validate a resolution-range engine where the encoding's tables nest; compare CUDA-graph
replays with plain runs, shapes alternating; profile with CUDA graphs on and off; list engine
layers with TensorRT's engine inspector; serve each flavour with ``deploykit serve`` under
concurrent load and compare its answers with ONNX Runtime; where a ``tritonserver`` binary is on
``PATH``, load the ``package triton`` repository and answer a request; build the SaPE² graph with
the SaPE² TensorRT plugin, check the engine holds one plugin layer per SaPE² node, and validate
it; with ``--plugin-library``, the same for an engine built with a plugin library; check the
SaPE² Triton bias kernel and fused attention against the float64 reference.

Each check is passed, failed (with the reason) or skipped (with the reason: no GPU, a package not
installed, no tolerance for a plan); the exit code is 1 when any check failed. The CPU parts
(export, ONNX Runtime validation, graph inspection, the TensorRT-RTX build) run anywhere, and CI
runs them on a tiny model (tests/test_gpu_acceptance.py). Polygraphy drives one TensorRT flavour
per process, so each flavour's engine checks run in a child process of this script (``--worker``).

    python benchmarks/gpu_acceptance.py                      # on the GPU machine; ~minutes per encoding
    python benchmarks/gpu_acceptance.py --encodings ape,sape2 --out /tmp/acceptance.json
    python benchmarks/gpu_acceptance.py --encodings sape2 --plugin-library libsape2.so   # a C++ plugin of yours
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from checks import Checks, Failed

from deploykit._io import write_json_atomic
from deploykit._lazy import is_available
from deploykit.errors import one_line
from deploykit.profile.environment import capture_environment, environment_line

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_acceptance.json"
FLAVOURS = {"rtx": "tensorrt_rtx", "trt": "tensorrt"}
NO_GPU = None if torch.cuda.is_available() else "no CUDA GPU here (torch.cuda.is_available() is False)"


def _report_validation(report) -> dict:
    records = [
        {
            "label": r.label,
            "provider": r.provider,
            "max_abs": r.max_abs,
            "cosine": r.cosine,
            "top1": r.top1_agreement,
            "passed": r.passed,
            "first_divergent_block": r.first_divergent_block,
        }
        for r in report.records
    ]
    if not report:
        raise Failed("; ".join(f"{r.label}: {', '.join(r.failures)}" for r in report.records if not r.passed), {"records": records})
    return {"records": records}


def validate_check(export_dir: Path, backend: str, precision: str, plugins=None):
    from deploykit.backends.plugins import Plugins
    from deploykit.validate import validate

    def check():
        return _report_validation(
            validate(export_dir, backends=[backend], precision=precision, num_random=4, num_real=8, plugins=plugins or Plugins())
        )

    return check


def no_tolerance(precision: str) -> str | None:
    from deploykit.validate import TOLERANCES

    return None if precision in TOLERANCES else f"validate has no tolerance for the {precision} plan yet"


# ----------------------------------------------------------------------------------------------
# the CPU parts, and the orchestration


def export_models(args, checks: Checks, work: Path) -> dict[str, Path]:
    """One export directory per encoding, every precision plan."""
    from deploykit.encodings import list_encodings
    from deploykit.export import export
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.export.precision import PRECISIONS

    calibration = CalibrationOptions(samples=args.calibration_samples, held_out=args.held_out, min_agreement=args.min_agreement)
    from deploykit.nn import create_model
    from deploykit.zoo.resolve import resolve_model

    exported = {}
    for encoding in args.encodings or list_encodings():
        out = work / encoding

        def do_export(encoding=encoding, out=out):
            if args.model:
                torch.manual_seed(0)
                overrides = {k: v for k, v in (("depth", args.depth), ("img_size", args.img_size)) if v}
                model = create_model(args.model, encoding=encoding, **overrides).eval()
            else:
                model, _ = resolve_model(encoding=encoding)
            base = model.default_shape
            resolutions = [tuple(base), *([] if args.one_resolution else [tuple(2 * s for s in base)])]
            manifest = export(model, resolutions, out, precisions=list(PRECISIONS), calibration=calibration)
            return {"graphs": [g.file for g in manifest.graphs]}

        if checks.run(f"export {encoding}", do_export) is not None:
            exported[encoding] = out
    return exported


def cpu_checks(exported: dict[str, Path], checks: Checks) -> None:
    import onnxruntime

    from deploykit.export.manifest import Manifest
    from deploykit.inspection import inspect_graph

    no_ort_cuda = None if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "onnxruntime has no CUDA provider"
    for encoding, out in exported.items():
        for precision in dict.fromkeys(g.precision for g in Manifest.read(out).graphs):
            cpu_bf16 = "ONNX Runtime's CPU provider has no bf16 Gemm/MatMul" if precision == "bf16" else None
            checks.run(
                f"validate ort {encoding} {precision}", validate_check(out, "ort", precision), skip=no_tolerance(precision) or cpu_bf16
            )
            checks.run(
                f"validate ort-cuda {encoding} {precision}",
                validate_check(out, "ort-cuda", precision),
                skip=no_ort_cuda or no_tolerance(precision),
            )
        first = out / Manifest.read(out).graphs[0].file

        def inspect(first=first):
            info = inspect_graph(first)["tensorrt_rtx"]
            if info["parsed"] is False:
                raise Failed("TensorRT-RTX's parser refused the graph", info)
            return info

        checks.run(f"inspect graph {encoding}", inspect)
        checks.run(f"ort-cuda node placement {encoding}", placement_check(first), skip=no_ort_cuda)


def placement_check(graph: Path):
    """Where ONNX Runtime's CUDA provider session runs each node: compute on the CPU fails."""
    from deploykit.runtime.onnxrt import OnnxrtCudaRunner

    def check():
        with OnnxrtCudaRunner(graph, allow_cpu_fallback=True) as runner:
            details = runner.details
        if details["node_placement"]["cpu_compute"]:
            raise Failed(details["placement_note"], details)
        return details

    return check


def run_worker(flavour: str, exported: dict[str, Path], args, work: Path) -> list[dict]:
    """The engine checks of one TensorRT flavour, in a child process (one flavour per process)."""
    out = work / f"{flavour}.json"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        flavour,
        "--out",
        str(out),
        "--budget",
        str(args.budget),
        *(["--plugin-library", args.plugin_library] if args.plugin_library else []),
        *[f"{encoding}={path}" for encoding, path in exported.items()],
    ]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if not out.is_file():
        return [{"name": f"{flavour} engine checks", "status": "failed", "reason": f"worker exited with {proc.returncode}, no report"}]
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------------
# one flavour's engine checks (in the worker)


def engine_checks(flavour: str, exported: dict[str, Path], budget_s: float, checks: Checks, plugin_library: str | None = None) -> None:
    from deploykit.build import build
    from deploykit.export.manifest import Manifest
    from deploykit.export.precision import PLANS

    module = FLAVOURS[flavour]
    missing = None if is_available(module) else f"{module} is not installed (pip install 'deploykit[{flavour}]')"
    for encoding, out in exported.items():
        checks.run(f"static-batch engine {flavour} {encoding}", static_engine_check(out, flavour), skip=missing or NO_GPU)
        checks.run(f"resolution-range engine {flavour} {encoding}", range_engine_check(out, flavour), skip=missing or NO_GPU)
        precisions = list(dict.fromkeys(g.precision for g in Manifest.read(out).graphs))
        built = checks.run(
            f"build {flavour} {encoding}",
            lambda out=out: {"engines": [e.engine.name for e in build(out, flavour, dynamic=True, batch=4, max_batch=8, rebuild=True)]},
            skip=missing,
        )
        cant_run = missing or (None if built else "the build failed") or NO_GPU
        for precision in precisions:
            checks.run(
                f"validate {flavour} {encoding} {precision} at every profiled shape",
                validate_check(out, flavour, precision),
                skip=cant_run or no_tolerance(precision) or PLANS[precision].ort_only or None,
            )
        checks.run(f"cuda graphs match plain runs {flavour} {encoding}, shapes alternating", cuda_graph_check(out, flavour), skip=cant_run)
        for graphs in (True, False):
            checks.run(
                f"profile {flavour} {encoding} cuda graphs {'on' if graphs else 'off'}",
                profile_check(out, flavour, graphs, budget_s),
                skip=cant_run,
            )
        checks.run(f"inspect engine {flavour} {encoding}", inspect_engine_check(out, flavour), skip=cant_run)
    if "sape2" in exported and flavour == "trt":  # TensorRT-RTX has no Python plugins
        checks.run(
            "sape2 with the TensorRT plugin",
            plugin_engine_check(exported["sape2"], flavour, ["sape2"]),
            skip=missing or NO_GPU or (None if is_available("triton") else "triton is not installed (pip install 'deploykit[triton]')"),
        )
    for encoding, out in exported.items():
        checks.run(
            f"{encoding} with the plugin library {plugin_library} on {flavour}",
            plugin_engine_check(out, flavour, [plugin_library]),
            skip=missing or NO_GPU or (None if plugin_library else "no --plugin-library given"),
        )


def _copy(out: Path, prefix: str) -> Path:
    copy = Path(tempfile.mkdtemp(prefix=prefix)) / "exp"
    shutil.copytree(out, copy)
    return copy


def static_engine_check(out: Path, flavour: str):
    """What plain ``deploykit build`` makes (static batch 1), validated."""
    from deploykit.build import build

    def check():
        copy = _copy(out, f"static_{flavour}_")
        build(copy, flavour, precisions=["fp32"], rebuild=True)
        return _report_validation(validate_check(copy, flavour, "fp32")())

    return check


def range_engine_check(out: Path, flavour: str):
    """A graph over a resolution range (``export --resolution-range``) built and validated at its
    min/opt/max; skipped for encodings whose tables do not nest."""
    from deploykit.build import build
    from deploykit.errors import ExportError
    from deploykit.export import export
    from deploykit.export.bundle import load_reference

    def check():
        model = load_reference(out)
        if not getattr(model.pos_enc, "tables_nest", False):
            return {"skipped": f"{model.cfg.encoding} tables do not nest over resolutions"}
        patch, (h, w) = model.cfg.patch_size, model.default_shape
        low, high = (h, w), (2 * h, 2 * w)
        opt = tuple((a + b) // 2 // patch * patch for a, b in zip(low, high))
        copy = Path(tempfile.mkdtemp(prefix=f"range_{flavour}_")) / "exp"
        try:
            export(model, [low], copy, resolution_range=(low, opt, high))
        except ExportError as err:
            raise Failed(f"range export refused: {err}") from err
        build(copy, flavour, dynamic=True, batch=2, max_batch=4, rebuild=True)
        return _report_validation(validate_check(copy, flavour, "fp32")())

    return check


def cuda_graph_check(out: Path, flavour: str):
    """The same engine with CUDA graphs and without, batches alternating (each batch is a shape
    with its own captured graph): replays must give the plain runs' outputs."""
    from deploykit.backends.registry import create_runner
    from deploykit.export.manifest import Manifest

    def check():
        graph = out / Manifest.read(out).graphs_at("fp32")[0].file
        rng = np.random.default_rng(0)
        batches = [1, 8, 4, 1, 8, 4, 1]
        worst = 0.0
        with create_runner(flavour, graph, cuda_graph=True) as graphs, create_runner(flavour, graph, cuda_graph=False) as plain:
            (name,) = plain.input_names()
            shape = tuple(next(iter(plain.profiled_shapes))[1:])
            for batch in batches:
                feed = {name: rng.standard_normal((batch, *shape), dtype=np.float32)}
                got, want = graphs.infer(feed), plain.infer(feed)
                worst = max(worst, max(float(np.abs(got[k] - want[k]).max()) for k in want))
            details = {"batches": batches, "max_abs_diff": worst, "cuda_graphs": graphs.cuda_graphs, "note": graphs.cuda_graph_note}
        if not details["cuda_graphs"]:
            raise Failed(f"CUDA graphs not used: {details['note']}", details)
        if worst > 1e-5:
            raise Failed("CUDA-graph replays differ from plain runs", details)
        return details

    return check


def profile_check(out: Path, flavour: str, cuda_graphs: bool, budget_s: float):
    from deploykit import profile as prof

    def check():
        subject = prof.Subject.from_export_dir(out)
        report = prof.profile(
            subject,
            resolutions=list(subject.graphs),
            batches=[1, 8],
            backends=[flavour],
            budget=prof.Budget(duration_s=budget_s),
            cuda_graphs=cuda_graphs,
        )
        rows = [
            {k: r[k] for k in ("encoding", "resolution", "batch", "p50_ms", "provider", "cuda_graph", "cuda_graph_note")}
            for r in report.records
        ]
        if cuda_graphs and not all(r["cuda_graph"] for r in rows):
            raise Failed("CUDA graphs requested but not used", {"records": rows, "notes": report.notes})
        return {"records": rows, "notes": report.notes}

    return check


def inspect_engine_check(out: Path, flavour: str):
    from deploykit.backends.engine_cache import engine_paths
    from deploykit.export.manifest import Manifest
    from deploykit.inspection import inspect_engine

    def check():
        graph = out / Manifest.read(out).graphs[0].file
        layers = inspect_engine(engine_paths(graph, FLAVOURS[flavour])[0])["layers"]
        if "count" not in layers:
            raise Failed(layers.get("note", "no layers"))
        precisions = sorted({o for layer in layers["layers"] for o in layer["outputs"]})
        return {"engine": graph.name, "layers": layers["count"], "output_formats": precisions}

    return check


def plugin_engine_check(out: Path, flavour: str, specs: list[str]):
    """The graph built with plugins: every custom node a registered plugin covers became a plugin
    layer (the fingerprint's count and the engine inspector's agree), and the engine validates."""
    import onnx

    from deploykit.backends.engine_cache import engine_paths, read_fingerprint
    from deploykit.backends.plugins import Plugins
    from deploykit.build import build
    from deploykit.export.manifest import Manifest
    from deploykit.export.plugin_nodes import STANDARD_DOMAINS
    from deploykit.inspection import inspect_engine
    from deploykit.validate import validate

    def check():
        copy = _copy(out, "plugins_")
        plugins = Plugins.resolve(specs)
        build(copy, flavour, precisions=["fp32"], rebuild=True, plugins=plugins)
        graph = copy / Manifest.read(copy).graphs_at("fp32")[0].file
        custom = sum(n.domain not in STANDARD_DOMAINS for n in onnx.load(str(graph), load_external_data=False).graph.node)
        recorded = read_fingerprint(engine_paths(graph, FLAVOURS[flavour])[1]).plugin_layers
        layers = inspect_engine(engine_paths(graph, FLAVOURS[flavour])[0])["layers"]
        details = {"custom_nodes": custom, "plugin_layers_recorded": recorded, "plugin_layers_in_engine": layers.get("plugin_layers")}
        if not custom or recorded != custom or layers.get("plugin_layers") != custom:
            raise Failed("the engine does not run every custom node as its plugin", details)
        return {**details, **_report_validation(validate(copy, backends=[flavour], precision="fp32", plugins=plugins))}

    return check


def kernel_check() -> dict:
    """The SaPE² Triton bias kernel and fused attention against the float64 reference (ViT-B heads, 384 px)."""
    import torch.nn.functional as F

    from deploykit.encodings.sape2 import MODES, sape2_bias_reference
    from deploykit.plugins.sape2.fused import sape2_attention_triton
    from deploykit.plugins.sape2.kernels import sape2_bias_triton

    heads, head_dim, grid, prefix = 12, 64, (24, 24), 1
    tokens = prefix + grid[0] * grid[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, tokens, head_dim, device="cuda", generator=gen) for _ in range(3))
    tx, ty = (torch.randn(head_dim, max(grid) + 1, device="cuda", generator=gen) for _ in range(2))
    scale, mode = head_dim**-0.5, MODES.index("k")
    with torch.no_grad():
        exact = sape2_bias_reference(q.double(), k.double(), tx.double(), ty.double(), grid, scale, "k", prefix)
        bias_err = ((sape2_bias_triton(q, k, tx, ty, grid, scale, mode, prefix).double() - exact).abs().max() / exact.abs().max()).item()
        reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=exact * scale)
        fused_err = (sape2_attention_triton(q, k, v, tx, ty, grid, scale, mode, prefix).double() - reference).abs().max().item()
    details = {"bias_rel_err": bias_err, "fused_max_abs_err": fused_err}
    if not (bias_err < 1e-3 and fused_err < 1e-2):
        raise Failed("SaPE² kernels disagree with the float64 reference", details)
    return details


# ----------------------------------------------------------------------------------------------
# serving


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def serving_check(out: Path, backend: str, requests: int = 200, concurrency: int = 16):
    """``deploykit serve --backend <engine>`` under ``concurrency`` concurrent requests: answers
    equal ONNX Runtime's in-process answers (fp32 tolerance) and the server's own sequential ones."""

    def check():
        import tritonclient.http as httpclient

        import deploykit
        from deploykit.serve.triton_server import logits_model_name
        from deploykit.validate import TOLERANCES, compare_logits

        http, grpc, metrics = _free_ports(3)
        cmd = [
            sys.executable,
            "-m",
            "deploykit",
            "serve",
            str(out),
            "--port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
            "--backend",
            backend,
        ]
        log = out / f"serve-{backend}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", concurrency=concurrency)
            _wait_ready(client, proc, log)
            with deploykit.load(out, backend="ort") as pipeline:
                resolution = pipeline.resolutions[0]
                inputs = np.random.default_rng(0).standard_normal((requests, 3, *resolution), dtype=np.float32)
                expected = pipeline.logits(inputs)

            def call(i):
                tensor = httpclient.InferInput("images", [1, 3, *resolution], "FP32")
                tensor.set_data_from_numpy(inputs[i : i + 1])
                return client.infer(logits_model_name(resolution), [tensor]).as_numpy("logits")[0]

            sequential = np.stack([call(i) for i in range(requests)])
            with ThreadPoolExecutor(concurrency) as pool:
                concurrent = np.stack(list(pool.map(call, range(requests))))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        vs_ort = compare_logits(expected, concurrent, requests, TOLERANCES["fp32"])
        vs_sequential = float(np.abs(concurrent - sequential).max())
        details = {
            "requests": requests,
            "concurrency": concurrency,
            "max_abs_vs_ort": vs_ort["max_abs"],
            "top1_vs_ort": vs_ort["top1_agreement"],
            "max_abs_concurrent_vs_sequential": vs_sequential,
        }
        if not vs_ort["passed"] or vs_sequential > TOLERANCES["fp32"].max_abs:
            raise Failed("served answers differ", details)
        return details

    return check


def tritonserver_check(out: Path):
    """The repository ``deploykit package triton`` writes, loaded by a real ``tritonserver``
    (the TensorRT engines the trt worker built, with a batch profile), answering one request per
    model kind like ONNX Runtime in-process."""

    def check():
        import tritonclient.http as httpclient

        import deploykit
        from deploykit.serve.triton_repo import package_triton
        from deploykit.validate import TOLERANCES, compare_logits

        repo = package_triton(out, Path(tempfile.mkdtemp(prefix="triton_repo_")) / "repo")
        http, grpc, metrics = _free_ports(3)
        log = repo.parent / "tritonserver.log"
        cmd = ["tritonserver", f"--model-repository={repo}", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
        with open(log, "wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
            _wait_ready(client, proc, log)
            with deploykit.load(out, backend="ort") as pipeline:
                resolution = pipeline.resolutions[0]
                images = np.random.default_rng(0).standard_normal((1, 3, *resolution), dtype=np.float32)
                expected = pipeline.logits(images)
            tag = "x".join(map(str, resolution)) if resolution[0] != resolution[1] else str(resolution[0])
            answers = {}
            for model in (f"vit_{tag}_trt", f"vit_{tag}_onnx"):
                tensor = httpclient.InferInput("images", [1, 3, *resolution], "FP32")
                tensor.set_data_from_numpy(images)
                answers[model] = compare_logits(expected, client.infer(model, [tensor]).as_numpy("logits"), 1, TOLERANCES["fp32"])
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        if not all(a["passed"] for a in answers.values()):
            raise Failed("tritonserver's answers differ from ONNX Runtime's", answers)
        return {m: {"max_abs": a["max_abs"]} for m, a in answers.items()}

    return check


def _wait_ready(client, proc, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"deploykit serve exited with {proc.returncode}: {one_line(log.read_text()[-600:])}")
        try:
            if client.is_server_ready():
                return
        except Exception:  # still starting: connection refused
            pass
        time.sleep(0.5)
    raise Failed(f"deploykit serve was not ready within {timeout_s:.0f} s")


# ----------------------------------------------------------------------------------------------


def worker_main(args) -> int:
    checks = Checks()
    exported = dict(item.split("=", 1) for item in args.items)
    engine_checks(args.worker, {k: Path(v) for k, v in exported.items()}, args.budget, checks, args.plugin_library)
    write_json_atomic(args.out, checks.items)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", type=lambda s: [e for e in s.split(",") if e], default=None, help="comma list; default all")
    parser.add_argument("--model", default=None, help="a seeded untrained model of this size instead of the zoo's trained ones")
    parser.add_argument("--depth", type=int, default=None, help="with --model: cut to this many blocks")
    parser.add_argument("--img-size", type=int, default=None, help="with --model: its own resolution")
    parser.add_argument("--one-resolution", action="store_true", help="export the model's own resolution only")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per profile measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--calibration-samples", type=int, default=128, help="INT8 calibration inputs per export")
    parser.add_argument("--held-out", type=int, default=1000, help="held-out inputs the INT8 plan is checked on")
    parser.add_argument(
        "--min-agreement",
        type=lambda v: None if v == "none" else float(v),
        default=0.995,
        help="INT8 agreement target ('none': no float fallback; for the CPU smoke run on an untrained model, where agreement means nothing)",
    )
    parser.add_argument("--plugin-library", default=None, help="a TensorRT plugin library (.so) to build the graphs with, for its checks")
    parser.add_argument("--worker", choices=sorted(FLAVOURS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("items", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)

    environment = capture_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    checks = Checks()
    work = Path(tempfile.mkdtemp(prefix="gpu_acceptance_"))
    exported = export_models(args, checks, work)
    cpu_checks(exported, checks)
    for flavour in FLAVOURS:
        checks.items += run_worker(flavour, exported, args, work)
    serve_missing = None if is_available("tritonclient") else "tritonclient is not installed (pip install 'deploykit[serve]')"
    for flavour, module in FLAVOURS.items():
        engine_missing = None if is_available(module) else f"{module} is not installed"
        for encoding, out in exported.items():
            checks.run(
                f"serve {flavour} {encoding} under concurrent load",
                serving_check(out, flavour),
                skip=engine_missing or NO_GPU or serve_missing,
            )
    no_tritonserver = None if shutil.which("tritonserver") else "no tritonserver binary on PATH"
    for encoding, out in exported.items():
        checks.run(f"tritonserver loads the packaged {encoding} repository", tritonserver_check(out), skip=no_tritonserver or NO_GPU)
    checks.run(
        "sape2 Triton kernels against the float64 reference",
        kernel_check,
        skip=NO_GPU or (None if is_available("triton") else "triton is not installed"),
    )
    counts = checks.counts()
    report = {
        "device": environment_line(environment),
        "summary": counts,
        "checks": checks.items,
        "environment": environment,
        "work_dir": str(work),
    }
    write_json_atomic(args.out, report)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; wrote {args.out}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU acceptance: everything about the engine path that CI (no GPU, no TensorRT) cannot check,
end to end, in one run, written to one JSON report that starts with the device line.

For every registered encoding (the zoo's trained model by default): export at two resolutions in
every precision plan export writes (``deploykit.export.precision.PLANS``, the imported one aside); validate each plan in ONNX
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
SaPE² Triton bias kernels against the float64 reference.

Each check is passed, failed (with the reason) or skipped (with the reason: no GPU, a GPU of a
compute capability the flavour does not support (TensorRT-RTX: none of A100, H100/H200, B200), a
package not installed, no tolerance for a plan, an encoding whose tables do not nest). Whether a
GPU is here is the CUDA driver's answer (``deploykit.backends.devices``), not torch's: a CPU build
of torch on a GPU host still runs the engine checks (Polygraphy allocates through CUDA itself).
The report's summary and the last printed line say how many engine checks (an engine run on the
GPU) ran. Exit code: 0 every check that ran passed; 1 a check failed; 2 a GPU is here but no
engine check ran (engine packages absent, or no flavour supports the GPU), so nothing was accepted.
The CPU parts (export, ONNX Runtime validation, graph inspection, the TensorRT-RTX build) run
anywhere, and CI runs them on a tiny model (tests/test_gpu_acceptance.py). Polygraphy drives one
TensorRT flavour per process, so each flavour's engine checks run in a child process of this
script (``--worker``).

    python benchmarks/gpu_acceptance.py                      # on the GPU machine; ~minutes per encoding
    python benchmarks/gpu_acceptance.py --encodings ape,sape2 --out /tmp/acceptance.json
    python benchmarks/gpu_acceptance.py --encodings sape2 --plugin-library libsape2.so   # a C++ plugin of yours
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from acceptance_serving import serving_check, tritonserver_check
from checks import Checks, Failed

from deploykit._io import write_json_atomic
from deploykit._lazy import is_available
from deploykit.backends.devices import Device, probe_device, supported_text, supports
from deploykit.backends.environment import capture_environment, environment_line
from deploykit.runners.table import engine_flavours

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_acceptance.json"
FLAVOURS = {tag: flavour.module for tag, flavour in reversed(engine_flavours().items())}  # TensorRT-RTX first
ENGINE = "engine"  # the group of the checks that run an engine on the GPU (counted in the summary)
NO_TORCH_CUDA = None if torch.cuda.is_available() else f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) cannot use the GPU"


def no_gpu(device: Device) -> str | None:
    """Why nothing can run on a GPU here (the CUDA driver's answer), or None."""
    return None if device.compute_capability else "no CUDA GPU here (the CUDA driver reports none)"


def unsupported(flavour: str, device: Device) -> str | None:
    """Why ``flavour`` does not run on this machine's GPU (its compute capability), or None (also
    without a GPU: TensorRT-RTX still builds engines there)."""
    module, cc = FLAVOURS[flavour], device.compute_capability
    if cc is None or supports(module, cc):
        return None
    return f"{device.gpu} (compute capability {cc}) is not supported by {flavour}, which runs on {supported_text(module)}"


def missing(flavour: str) -> str | None:
    module = FLAVOURS[flavour]
    return None if is_available(module) else f"{module} is not installed (pip install 'deploykit[{flavour}]')"


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
    from deploykit.validation.run import validate

    def check():
        return _report_validation(
            validate(export_dir, backends=[backend], precision=precision, num_random=4, num_real=8, plugins=plugins or Plugins())
        )

    return check


def no_tolerance(precision: str) -> str | None:
    from deploykit.export.precision import PLANS

    return None if precision in PLANS else f"validate has no tolerance for the {precision} plan yet"


# ----------------------------------------------------------------------------------------------
# the CPU parts, and the orchestration


GPU_ONLY_PLANS = ("fp8", "int8-fp16")


def export_models(args, checks: Checks, work: Path) -> dict[str, Path]:
    """One export directory per encoding, every precision plan."""
    from deploykit.encodings import list_encodings
    from deploykit.export import export
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.export.precision import PLANS

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
            # an imported plan comes with its own graph; the FP8/INT8-over-fp16 plans build for
            # compute capability 8.9+ only, and RTX's build here targets less (their builds are
            # tests/export/test_gpu_plans.py's, for an 8.9 target)
            written = [name for name, plan in PLANS.items() if not plan.imported and name not in GPU_ONLY_PLANS]
            manifest = export(model, resolutions, out, precisions=written, calibration=calibration)
            return {"graphs": [g.file for g in manifest.graphs]}

        if checks.run(f"export {encoding}", do_export) is not None:
            exported[encoding] = out
    return exported


def cpu_checks(exported: dict[str, Path], checks: Checks) -> None:
    import onnxruntime

    from deploykit.backends.inspection import inspect_graph
    from deploykit.export.manifest import Manifest

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
    from deploykit.runners.onnxrt import OnnxrtCudaRunner

    def check():
        with OnnxrtCudaRunner(graph, allow_cpu_fallback=True) as runner:
            details = runner.info.to_dict()
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
        return [
            {
                "name": f"{flavour} engine checks",
                "group": ENGINE,
                "status": "failed",
                "reason": f"worker exited with {proc.returncode}, no report",
            }
        ]
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------------
# one flavour's engine checks (in the worker)


def engine_checks(
    flavour: str, exported: dict[str, Path], budget_s: float, checks: Checks, device: Device, plugin_library: str | None = None
) -> None:
    """Build, validate, replay, profile and inspect ``flavour``'s engines of each export on ``device``
    (what ``probe_device`` reports); each check skipped with the reason where it cannot run."""
    from deploykit.backends.build import build
    from deploykit.export.manifest import Manifest
    from deploykit.export.precision import PLANS

    cannot_build = missing(flavour) or unsupported(flavour, device)
    cannot_run = cannot_build or no_gpu(device)
    own_graphs = NO_TORCH_CUDA if flavour == "trt" else None  # TensorRT's CUDA graphs live in torch's buffers; RTX's in itself
    for encoding, out in exported.items():
        checks.run(f"static-batch engine {flavour} {encoding}", static_engine_check(out, flavour), skip=cannot_run, group=ENGINE)
        checks.run(
            f"resolution-range engine {flavour} {encoding}",
            range_engine_check(out, flavour),
            skip=range_skip(out) or cannot_run,
            group=ENGINE,
        )
        precisions = list(dict.fromkeys(g.precision for g in Manifest.read(out).graphs))
        built = checks.run(
            f"build {flavour} {encoding}",
            lambda out=out: {"engines": [e.engine.name for e in build(out, flavour, dynamic=True, batch=4, max_batch=8, rebuild=True)]},
            skip=cannot_build,
        )
        run_built = cannot_run or (None if built else "the build failed")
        for precision in precisions:
            checks.run(
                f"validate {flavour} {encoding} {precision} at every profiled shape",
                validate_check(out, flavour, precision),
                skip=run_built or no_tolerance(precision) or PLANS[precision].ort_only or None,
                group=ENGINE,
            )
        checks.run(
            f"cuda graphs match plain runs {flavour} {encoding}, shapes alternating",
            cuda_graph_check(out, flavour),
            skip=run_built or own_graphs,
            group=ENGINE,
        )
        for graphs in (True, False):
            checks.run(
                f"profile {flavour} {encoding} cuda graphs {'on' if graphs else 'off'}",
                profile_check(out, flavour, graphs, budget_s),
                skip=run_built or (own_graphs if graphs else None),
                group=ENGINE,
            )
        checks.run(f"inspect engine {flavour} {encoding}", inspect_engine_check(out, flavour), skip=run_built, group=ENGINE)
        # TensorRT-RTX's builder compiles a refittable graph with CUDA: on a CPU host it refuses (test_engine_kinds)
        checks.run(f"weight-stripped engines {flavour} {encoding}", stripped_engine_check(out, flavour), skip=cannot_run, group=ENGINE)
    if "sape2" in exported and flavour == "trt":  # TensorRT-RTX has no Python plugins
        checks.run(
            "sape2 with the TensorRT plugin",
            plugin_engine_check(exported["sape2"], flavour, ["sape2"]),
            skip=cannot_run or (None if is_available("triton") else "triton is not installed (pip install 'deploykit[triton]')"),
            group=ENGINE,
        )
    for encoding, out in exported.items():
        checks.run(
            f"{encoding} with the plugin library {plugin_library} on {flavour}",
            plugin_engine_check(out, flavour, [plugin_library]),
            skip=cannot_run or (None if plugin_library else "no --plugin-library given"),
            group=ENGINE,
        )


def _copy(out: Path, prefix: str) -> Path:
    copy = Path(tempfile.mkdtemp(prefix=prefix)) / "exp"
    shutil.copytree(out, copy)
    return copy


def static_engine_check(out: Path, flavour: str):
    """What plain ``deploykit build`` makes (static batch 1), validated."""
    from deploykit.backends.build import build

    def check():
        copy = _copy(out, f"static_{flavour}_")
        build(copy, flavour, precisions=["fp32"], rebuild=True)
        return _report_validation(validate_check(copy, flavour, "fp32")())

    return check


def stripped_engine_check(out: Path, flavour: str):
    """``build --strip-weights`` for every exported resolution: each engine smaller on disk than the
    refittable one built with its weights, one weight set beside them (each distinct initializer
    once), and the stripped engines, refitted from it when loaded, validated."""
    from deploykit.backends.build import build
    from deploykit.export.directory import shared_weights_file

    def check():
        full, stripped = _copy(out, f"weights_{flavour}_"), _copy(out, f"stripped_{flavour}_")
        with_weights = build(full, flavour, precisions=["fp32"], refittable=True, rebuild=True)
        without = build(stripped, flavour, precisions=["fp32"], strip_weights=True, rebuild=True)
        sizes = {s.graph: [w.engine.stat().st_size, s.engine.stat().st_size] for w, s in zip(with_weights, without)}
        details = {
            "engine_bytes_with_and_without_weights": sizes,
            "weight_set_bytes": shared_weights_file(stripped, flavour).stat().st_size,
        }
        if any(bare >= whole for whole, bare in sizes.values()):
            raise Failed("a weight-stripped engine is not smaller than the engine with its weights", details)
        details["validation"] = _report_validation(validate_check(stripped, flavour, "fp32")())
        return details

    return check


def range_skip(out: Path) -> str | None:
    """Why no resolution-range graph can be made of this export: its encoding's tables do not nest
    (resized or normalised to the grid, so each resolution needs its own), or None."""
    from deploykit.export.bundle import load_reference
    from deploykit.export.manifest import Manifest

    if getattr(load_reference(out).pos_enc, "tables_nest", False):
        return None
    return f"{Manifest.read(out).encoding} tables do not nest over resolutions: a resolution range needs one graph per resolution"


def range_engine_check(out: Path, flavour: str):
    """A graph over a resolution range (``export --resolution-range``) built and validated at its
    min/opt/max (for encodings whose tables nest: ``range_skip``)."""
    from deploykit.backends.build import build
    from deploykit.errors import ExportError
    from deploykit.export import export
    from deploykit.export.bundle import load_reference

    def check():
        model = load_reference(out)
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
            # Read after the runs: the runner says whether its executions were (or could be) captured.
            details = {"batches": batches, "max_abs_diff": worst, "cuda_graphs": graphs.cuda_graphs, "note": graphs.cuda_graph_note}
        if not details["cuda_graphs"]:
            raise Failed(f"CUDA graphs not used: {details['note']}", details)
        if worst > 1e-5:
            raise Failed("CUDA-graph replays differ from plain runs", details)
        return details

    return check


def profile_check(out: Path, flavour: str, cuda_graphs: bool, budget_s: float):
    from deploykit.profile import Budget, Subject
    from deploykit.profile import profile as run_profile

    def check():
        subject = Subject.from_export_dir(out)
        report = run_profile(
            subject,
            resolutions=list(subject.graphs),
            batches=[1, 8],
            backends=[flavour],
            budget=Budget(duration_s=budget_s),
            cuda_graphs=cuda_graphs,
        )
        rows = [
            {k: r[k] for k in ("encoding", "resolution", "batch", "p50_ms", "provider", "cuda_graph", "cuda_graph_note")}
            for r in report.to_json()["records"]
        ]
        if cuda_graphs and not all(r["cuda_graph"] for r in rows):
            raise Failed("CUDA graphs requested but not used", {"records": rows, "notes": report.notes})
        return {"records": rows, "notes": report.notes}

    return check


def inspect_engine_check(out: Path, flavour: str):
    """TensorRT's engine inspector on the built engine: it lists as many layers as the engine
    has, at least one, and their names are the graph's (TensorRT names a layer after the ONNX
    nodes it fused), so the list is this engine's and not an empty or foreign one."""
    import onnx

    from deploykit.backends.engine_cache import engine_paths
    from deploykit.backends.inspection import inspect_engine
    from deploykit.export.manifest import Manifest

    def check():
        graph = out / Manifest.read(out).graphs[0].file
        layers = inspect_engine(engine_paths(graph, FLAVOURS[flavour])[0])["layers"]
        if "count" not in layers:
            raise Failed(layers.get("note", "no layers"))
        names = [layer["name"] for layer in layers["layers"]]
        nodes = [n.name for n in onnx.load(str(graph), load_external_data=False).graph.node if n.name]
        named = sum(any(node in name for node in nodes) for name in names)
        details = {
            "engine": graph.name,
            "layers": layers["count"],
            "listed": len(names),
            "named_after_graph_nodes": named,
            "types": sorted({str(layer["type"]) for layer in layers["layers"]}),
            "output_formats": sorted({o for layer in layers["layers"] for o in layer["outputs"]}),
        }
        if not names or len(names) != layers["count"]:
            raise Failed(f"the inspector listed {len(names)} layer(s) of an engine of {layers['count']}", details)
        if not named:
            raise Failed("no layer is named after a node of the graph the engine was built from", details)
        return details

    return check


def plugin_engine_check(out: Path, flavour: str, specs: list[str]):
    """The graph built with plugins: every custom node a registered plugin covers became a plugin
    layer (the fingerprint's count and the engine inspector's agree), and the engine validates."""
    import onnx

    from deploykit.backends.build import build
    from deploykit.backends.engine_cache import engine_paths, read_fingerprint
    from deploykit.backends.inspection import inspect_engine
    from deploykit.backends.plugins import Plugins
    from deploykit.export.manifest import Manifest
    from deploykit.graph.plugin_nodes import STANDARD_DOMAINS
    from deploykit.validation.run import validate

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
    """The SaPE² Triton bias kernels (signatures once, then distances) against the float64 reference (ViT-B heads, 384 px)."""
    from deploykit.encodings.sape2 import MODES, sape2_bias_reference
    from deploykit.plugins.sape2.kernels import sape2_bias_triton

    heads, head_dim, grid, prefix = 12, 64, (24, 24), 1
    tokens = prefix + grid[0] * grid[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, heads, tokens, head_dim, device="cuda", generator=gen) for _ in range(2))
    tx, ty = (torch.randn(head_dim, max(grid) + 1, device="cuda", generator=gen) for _ in range(2))
    scale, mode = head_dim**-0.5, MODES.index("k")
    with torch.no_grad():
        exact = sape2_bias_reference(q.double(), k.double(), tx.double(), ty.double(), grid, scale, "k", prefix)
        bias_err = ((sape2_bias_triton(q, k, tx, ty, grid, scale, mode, prefix).double() - exact).abs().max() / exact.abs().max()).item()
    details = {"bias_rel_err": bias_err}
    if not bias_err < 1e-3:
        raise Failed("the SaPE² kernels disagree with the float64 reference", details)
    return details


# ----------------------------------------------------------------------------------------------


def worker_main(args) -> int:
    checks = Checks()
    exported = dict(item.split("=", 1) for item in args.items)
    engine_checks(args.worker, {k: Path(v) for k, v in exported.items()}, args.budget, checks, probe_device(), args.plugin_library)
    write_json_atomic(args.out, checks.items)
    return 0


def summary(checks: Checks, device: Device) -> tuple[dict, str, int]:
    """The report's summary, the run's last line and its exit code (module docstring): a GPU here
    with no engine check run is exit 2, whatever else passed."""
    counts, ran = checks.counts(), checks.ran(ENGINE)
    code = 1 if counts["failed"] else 2 if device.compute_capability and not ran else 0
    where = f"on {device.gpu} (compute capability {device.compute_capability})" if device.compute_capability else "(no GPU here)"
    line = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; {ran} engine check(s) ran {where}"
    if code == 2:
        line += "; a GPU is here but no engine check ran: nothing of the engine path was accepted (exit 2)"
    return {**counts, "engine_checks_ran": ran}, line, code


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

    device = probe_device()
    environment = capture_environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    checks = Checks()
    work = Path(tempfile.mkdtemp(prefix="gpu_acceptance_"))
    exported = export_models(args, checks, work)
    cpu_checks(exported, checks)
    for flavour in FLAVOURS:
        for item in run_worker(flavour, exported, args, work):
            checks.add(item)
    serve_missing = None if is_available("tritonclient") else "tritonclient is not installed (pip install 'deploykit[serve]')"
    for flavour in FLAVOURS:
        for encoding, out in exported.items():
            checks.run(
                f"serve {flavour} {encoding} under concurrent load",
                serving_check(out, flavour),
                skip=missing(flavour) or unsupported(flavour, device) or no_gpu(device) or serve_missing,
                group=ENGINE,
            )
    no_tritonserver = None if shutil.which("tritonserver") else "no tritonserver binary on PATH"
    for encoding, out in exported.items():
        checks.run(
            f"tritonserver loads the packaged {encoding} repository",
            tritonserver_check(out),
            skip=no_tritonserver or no_gpu(device),
            group=ENGINE,
        )
    checks.run(
        "sape2 Triton kernels against the float64 reference",
        kernel_check,
        skip=no_gpu(device) or NO_TORCH_CUDA or (None if is_available("triton") else "triton is not installed"),
    )
    counts, line, code = summary(checks, device)
    report = {
        "device": environment_line(environment),
        "gpu": dataclasses.asdict(device),  # the CUDA driver's answer (the device line is torch's)
        "summary": counts,
        "checks": checks.items,
        "environment": environment,
        "work_dir": str(work),
    }
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}")
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``deploykit validate --bundle DIR``: a check anyone can replay without deploykit.

The bundle holds, for each graph validated: the graph itself, the inputs deploykit ran and the
float64 PyTorch reference outputs on them, in the forms each tool reads:

- ``trtexec``: one raw little-endian file per tensor (``--loadInputs=name:file``,
  ``--loadRefOutputs=name:file``; the flags and the ``name:file`` form as NVIDIA's
  ``samples/trtexec/README.md`` documents them, with ``--accuracyAlgorithm`` and
  ``--accuracyThreshold``, which newer trtexec builds have; ``TRTEXEC_FLAGS``);
- Polygraphy: ``inputs.json`` (a list of feed dicts, ``polygraphy.json.save_json``) for
  ``--load-inputs`` and ``reference.json`` (a ``RunResults``) for ``--load-outputs``;
- numpy: ``.npy`` files, read by ``replay_ort.py`` (``deploykit.validation.replay_script``), which replays
  the check with ONNX Runtime alone and, when it fails, names the first divergent block from the
  per-block reference activations (``blocks.npz``) and the graph with its block outputs marked.

For each failing check whose first divergent layer was found, ``divergence/<check>.json`` names it
(engine layer, ONNX nodes, module, the error there) with every measured node's error, largest
first, and ``divergence/<check>.node_data.json`` holds those errors as Model Explorer's node data
(``model-explorer-onnx``: ``onnxvis GRAPH --node_data_paths=FILE`` colours each node by it).

``bundle.json`` records the tolerance deploykit judged by, the report, the engines' fingerprints
found beside the graphs, and the environment; ``README.md`` and ``commands.sh`` give the exact
command lines. The reference is computed in float64 and stored as the graph's output dtype for
trtexec and Polygraphy (they compare like with like), and in float64 for the ONNX Runtime replay.

A bundle is written whole or not at all (``staged_directory``); an existing ``DIR`` that is not a
bundle is refused, never replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from deploykit._io import staged_directory, write_json_atomic, write_text_atomic
from deploykit._lazy import lazy_import
from deploykit.backends import TorchRunner
from deploykit.checks import Reference, Tolerance
from deploykit.errors import ConfigError
from deploykit.export.directory import engine_files
from deploykit.inputs.resolutions import resolution_tag
from deploykit.nn.factory import Model
from deploykit.nn.spec import block_paths
from deploykit.runners.base import run_batched
from deploykit.validation.layer_map import DivergentLayer, NodeError, marked_graph, node_data, node_origins

BUNDLE_VERSION = 1
BUNDLE_FILE = "bundle.json"
REPLAY_SCRIPT = "replay_ort.py"
REFERENCE_RUNNER = "pytorch-float64"  # the runner name the Polygraphy results carry

# trtexec's flags the commands use, each as NVIDIA documents it (samples/trtexec/README.md: "Using
# custom input data", "Example 3" for --shapes, "Example 6" for --stronglyTyped, "7.5: Accuracy-aware
# tuning" for the accuracy flags, whose --accuracyThreshold is required once --loadRefOutputs is given).
TRTEXEC_FLAGS = ("--onnx", "--stronglyTyped", "--shapes", "--loadInputs", "--loadRefOutputs", "--accuracyAlgorithm", "--accuracyThreshold")
TRTEXEC_ALGORITHMS = ("l0", "l1", "l2", "lInf", "cos")


@dataclass(frozen=True)
class BundleCheck:
    """One graph at one resolution as the bundle holds it: what a replay runs and compares."""

    graph: str
    resolution: tuple[int, ...]
    inputs: dict[str, dict[str, str]]  # tensor name → {"raw", "npy", "shape", "dtype"}
    outputs: dict[str, dict[str, str]]
    polygraphy_inputs: str
    polygraphy_outputs: str
    blocks: dict | None  # {"graph", "reference", "names": [{"module", "tensor"}]}

    def to_dict(self) -> dict:
        return {
            "graph": self.graph,
            "resolution": list(self.resolution),
            "inputs": self.inputs,
            "outputs": self.outputs,
            "polygraphy_inputs": self.polygraphy_inputs,
            "polygraphy_outputs": self.polygraphy_outputs,
            "blocks": self.blocks,
        }


@dataclass(frozen=True)
class Divergent:
    """A failing check's divergence as validate found it: what ``divergence/`` holds."""

    label: str  # the report's label of the check (``ort@48``)
    graph: Path  # the graph checked
    block: str | None
    layer: DivergentLayer | None
    errors: tuple[NodeError, ...]

    @property
    def stem(self) -> str:
        return _safe(self.label)


@dataclass(frozen=True)
class Bundle:
    """What ``write_bundle`` wrote."""

    path: Path
    checks: tuple[BundleCheck, ...]
    commands: tuple[str, ...]
    divergences: tuple[str, ...] = ()  # the files of ``divergence/``


def check_bundle_destination(dest: str | os.PathLike) -> None:
    """Refuse, before any work, a ``dest`` that exists and is not an earlier bundle (a non-empty
    directory without ``bundle.json``, or a file): it is never replaced."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / BUNDLE_FILE).is_file())):
        raise ConfigError(f"--bundle {dest} exists and is not a validate bundle; give a new or empty directory")


def write_bundle(
    dest: str | os.PathLike,
    model: Model,
    graphs: Sequence[tuple[Path, tuple[int, ...], Reference]],
    tolerance: Tolerance,
    *,
    precision: str,
    report: list[dict],
    divergent: Sequence[Divergent] = (),
) -> Bundle:
    """Write the replay bundle for ``graphs`` (each graph's path, resolution and the reference it
    was judged against) into ``dest``, with ``divergent``: where failing checks diverged.

    Raises:
        ConfigError: ``dest`` exists and is not a bundle.
        MissingDependencyError: Polygraphy is not installed (its JSON forms are written by it).
    """
    check_bundle_destination(dest)
    dest = Path(dest)
    with staged_directory(dest) as stage:
        checks = tuple(_write_check(stage, model, path, resolution, reference) for path, resolution, reference in graphs)
        commands = tuple(c for check in checks for c in replay_commands(check, tolerance))
        shutil.copyfile(Path(__file__).with_name("replay_script.py"), stage / REPLAY_SCRIPT)
        fingerprints = _copy_fingerprints(stage, [path for path, _, _ in graphs])
        divergences = tuple(f for d in divergent if d.errors for f in _write_divergence(stage, d))
        write_json_atomic(
            stage / BUNDLE_FILE,
            {
                "version": BUNDLE_VERSION,
                "precision": precision,
                "tolerance": tolerance.to_dict(),
                "checks": [c.to_dict() for c in checks],
                "commands": list(commands),
                "fingerprints": fingerprints,
                "divergences": list(divergences),
                "report": report,
                "environment": _environment(),
            },
        )
        write_text_atomic(stage / "commands.sh", "#!/bin/sh\n# Run from this directory; see README.md.\n" + "\n".join(commands) + "\n")
        write_text_atomic(stage / "README.md", _readme(checks, commands, tolerance, precision, divergent))
    return Bundle(dest, checks, commands, divergences)


DIVERGENCE_DIR = "divergence"


def _write_divergence(stage: Path, divergent: Divergent) -> tuple[str, str]:
    """``divergence/<check>.json`` (the first divergent layer, each measured node's error largest
    first) and ``divergence/<check>.node_data.json`` (Model Explorer's node data); their paths."""
    (stage / DIVERGENCE_DIR).mkdir(exist_ok=True)
    summary, overlay = f"{DIVERGENCE_DIR}/{divergent.stem}.json", f"{DIVERGENCE_DIR}/{divergent.stem}.node_data.json"
    ranked = sorted(divergent.errors, key=lambda e: -e.max_abs)
    write_json_atomic(
        stage / summary,
        {
            "check": divergent.label,
            "graph": divergent.graph.name,
            "first_divergent_block": divergent.block,
            "first_divergent_layer": None if divergent.layer is None else dataclasses.asdict(divergent.layer),
            "node_errors": [e.to_dict() for e in ranked],
            "node_data": overlay,
        },
    )
    graph_id = onnx.load(str(divergent.graph), load_external_data=False).graph.name
    write_json_atomic(stage / overlay, node_data(graph_id, divergent.errors, divergent.layer))
    return summary, overlay


def _write_check(stage: Path, model: Model, graph: Path, resolution: tuple[int, ...], reference: Reference) -> BundleCheck:
    proto = onnx.load(str(graph))
    shutil.copyfile(graph, stage / graph.name)  # the graph as validated (tables baked, no external data)
    folder = f"r{resolution_tag(resolution)}_{graph.stem}"
    (stage / folder).mkdir()
    (graph_input,), graph_output = proto.graph.input, proto.graph.output[0]
    inputs = {graph_input.name: reference.inputs.astype(_np_dtype(graph_input))}
    # The reference in float64 for the ONNX Runtime replay; as the graph's output dtype for the tools.
    outputs64 = {graph_output.name: np.asarray(reference.outputs, dtype=np.float64)}
    outputs = {graph_output.name: outputs64[graph_output.name].astype(_np_dtype(graph_output))}
    input_files = {name: _save_tensor(stage, folder, name, array) for name, array in inputs.items()}
    output_files = {name: _save_tensor(stage, folder, name, outputs[name], outputs64[name]) for name in outputs}
    pg_inputs, pg_outputs = _save_polygraphy(stage, folder, inputs, outputs)
    blocks = _save_blocks(stage, folder, model, graph, reference.inputs)
    # What TensorRT names its layers after (ONNX nodes, fused as "a + b" or "{ForeignNode[a...b]}"), to the modules they come from.
    write_json_atomic(stage / folder / "nodes.json", [o.to_dict() for o in node_origins(proto)])
    return BundleCheck(graph.name, tuple(resolution), input_files, output_files, pg_inputs, pg_outputs, blocks)


def _np_dtype(value_info: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type))


def _save_tensor(stage: Path, folder: str, name: str, array: np.ndarray, npy: np.ndarray | None = None) -> dict:
    """``name``'s raw file (C order, little-endian, as numpy's ``tofile`` writes and trtexec reads)
    and its ``.npy`` (``npy`` when given: the float64 reference)."""
    stem = f"{folder}/{_safe(name)}"
    np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tofile(stage / f"{stem}.bin")
    np.save(stage / f"{stem}.npy", array if npy is None else npy)
    return {"raw": f"{stem}.bin", "npy": f"{stem}.npy", "shape": list(array.shape), "dtype": str(array.dtype)}


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _save_polygraphy(stage: Path, folder: str, inputs: dict, outputs: dict) -> tuple[str, str]:
    """Polygraphy's own JSON forms, written by Polygraphy: a one-iteration list of feed dicts
    (``--load-inputs``) and a ``RunResults`` of one runner (``--load-outputs``)."""
    json_mod = lazy_import("polygraphy.json", "rtx")
    comparator = lazy_import("polygraphy.comparator", "rtx")
    logger = lazy_import("polygraphy.logger", "rtx").G_LOGGER
    inputs_file, outputs_file = f"{folder}/inputs.json", f"{folder}/reference.json"
    with logger.verbosity(logger.WARNING):  # not its "Saving inference results to <staging path>"
        json_mod.save_json([inputs], str(stage / inputs_file))
        iteration = comparator.IterationResult(outputs=dict(outputs), runner_name=REFERENCE_RUNNER)
        comparator.RunResults([(REFERENCE_RUNNER, [iteration])]).save(str(stage / outputs_file))
    return inputs_file, outputs_file


def _save_blocks(stage: Path, folder: str, model: Model, graph: Path, inputs: np.ndarray) -> dict | None:
    """Each block's float64 reference output (``blocks.npz``, keyed by module path) and the graph
    with the block outputs marked, for the replay's first-divergent-block search; None when the
    graph recorded no block outputs."""

    marked, tensors = marked_graph(graph)
    if not tensors:
        return None
    with TorchRunner(model, return_blocks=True) as runner:
        activations = run_batched(runner, inputs, 8)
    modules = block_paths(model)
    np.savez(stage / folder / "blocks.npz", **{m: activations[m] for m in modules})
    marked_name = f"{folder}/{graph.stem}.blocks.onnx"
    (stage / marked_name).write_bytes(marked)
    names = [{"module": m, "tensor": t} for m, t in zip(modules, tensors, strict=True)]
    return {"graph": marked_name, "reference": f"{folder}/blocks.npz", "names": names}


def replay_commands(check: BundleCheck, tolerance: Tolerance) -> list[str]:
    """The command lines that replay ``check``, run from the bundle's directory: trtexec (max abs,
    then cosine), Polygraphy with TensorRT and with ONNX Runtime, and the numpy replay."""
    (in_name, in_files), (out_name, out_files) = next(iter(check.inputs.items())), next(iter(check.outputs.items()))
    shape = "x".join(str(d) for d in in_files["shape"])
    trtexec = [
        "trtexec",
        f"--onnx={check.graph}",
        "--stronglyTyped",
        f"--shapes={in_name}:{shape}",
        f"--loadInputs={in_name}:{in_files['raw']}",
        f"--loadRefOutputs={out_name}:{out_files['raw']}",
    ]
    # trtexec's "cos" is 1 - cosine over the whole tensor; deploykit's bar is the worst row's cosine.
    bars = [("cos", 1.0 - tolerance.min_cosine)]
    if tolerance.max_abs is not None:
        bars.insert(0, ("lInf", tolerance.max_abs))
    commands = [shlex.join([*trtexec, f"--accuracyAlgorithm={algo}", f"--accuracyThreshold={value:.6g}"]) for algo, value in bars]
    if tolerance.max_abs is not None:  # Polygraphy compares by error bounds, with no cosine
        shape_arg = f"{in_name}:[{','.join(str(d) for d in in_files['shape'])}]"
        for runner in ("--trt", "--onnxrt"):
            polygraphy = ["polygraphy", "run", check.graph, runner, *(["--strongly-typed"] if runner == "--trt" else [])]
            polygraphy += [
                "--input-shapes",
                shape_arg,
                "--load-inputs",
                check.polygraphy_inputs,
                "--load-outputs",
                check.polygraphy_outputs,
            ]
            polygraphy += ["--atol", f"{tolerance.max_abs:.6g}", "--rtol", "0", "--check-error-stat", "max"]
            commands.append(shlex.join(polygraphy))
        # Layer by layer, TensorRT against ONNX Runtime with every tensor marked ("*": Polygraphy 0.53 deprecates "mark all"; it changes fusion and
        # needs memory: for locating a divergence on a small model); nodes.json maps each tensor to its module.
        layerwise = ["polygraphy", "run", check.graph, "--trt", "--strongly-typed", "--onnxrt", "--input-shapes", shape_arg]
        layerwise += ["--load-inputs", check.polygraphy_inputs, "--trt-outputs", "*", "--onnx-outputs", "*"]
        layerwise += ["--atol", f"{tolerance.max_abs:.6g}", "--rtol", "0", "--check-error-stat", "max", "--fail-fast"]
        commands.append(shlex.join(layerwise))
    return commands


def _copy_fingerprints(stage: Path, graphs: Sequence[Path]) -> dict[str, dict]:
    """The fingerprints of the engines ``deploykit build`` wrote beside ``graphs`` (the engines
    themselves stay behind: they run only on the GPU, TensorRT and driver they were built for)."""
    found = {}
    for graph in graphs:
        for tag in ("trt", "rtx"):
            _, fingerprint = engine_files(graph, tag)
            if fingerprint.is_file():
                shutil.copyfile(fingerprint, stage / fingerprint.name)
                found[fingerprint.name] = json.loads(fingerprint.read_text())
    return found


def _environment() -> dict:
    import torch

    from deploykit.backends.environment import capture_environment

    return capture_environment(torch.device("cpu"))


def _readme(
    checks: Sequence[BundleCheck], commands: Sequence[str], tolerance: Tolerance, precision: str, divergent: Sequence[Divergent]
) -> str:
    graphs = ", ".join(f"{c.graph} at {resolution_tag(c.resolution)}" for c in checks)
    lines = [
        "# deploykit validation bundle",
        "",
        f"Graphs: {graphs} ({precision} plan). Reference: the PyTorch model in float64 on the inputs saved here.",
        f"Tolerance deploykit judged by: {json.dumps(tolerance.to_dict())} (max abs error; worst and mean per-input cosine).",
        "",
        "Replay from this directory on any host. Without TensorRT (numpy and onnxruntime only):",
        "",
        f"    python {REPLAY_SCRIPT}",
        "",
        "With TensorRT (`commands.sh` holds every line). trtexec's `--accuracyAlgorithm`/`--accuracyThreshold` need a",
        "trtexec that lists them in `trtexec --help`; its `cos` is over the whole output tensor, looser than the",
        "per-input cosine above. Polygraphy has no cosine comparison, so it checks the max abs error (its last line per",
        "graph compares TensorRT with ONNX Runtime tensor by tensor, stopping at the first that differs)"
        + ("." if tolerance.max_abs is not None else ": this plan has no max-abs bar, so no Polygraphy line is given."),
        "",
        *(f"    {c}" for c in commands),
        "",
        "Files: `bundle.json` (tolerance, report, engine fingerprints, environment); per check a folder with raw `.bin`",
        "tensors (trtexec), `.npy` (float64 reference), `inputs.json`/`reference.json` (Polygraphy), and `blocks.npz`",
        "with the graph whose block outputs are marked (first divergent block), and `nodes.json`: each ONNX node (what",
        "TensorRT names a layer after; a fused layer is `a + b` or `{ForeignNode[a...b]}`, the nodes from a to b) with the",
        "module it comes from, so a layer Polygraphy or trtexec reports maps back to the model.",
        "",
    ]
    found = [d for d in divergent if d.errors]
    if found:
        lines += ["Where the failing checks diverged (`divergence/`: each measured node's error, largest first):", ""]
        for d in found:
            where = d.layer.describe() if d.layer else f"no module of {d.block} left the tolerance on its own"
            lines.append(f"- {d.label}: first divergent block {d.block}; {where}")
        overlays = ",".join(f"{DIVERGENCE_DIR}/{d.stem}.node_data.json" for d in found)
        lines += ["", "Model Explorer (`pip install model-explorer-onnx`) colours each node by its error:", ""]
        lines += [f"    onnxvis {found[0].graph.name} --node_data_paths={overlays}", ""]
    return "\n".join(lines)

"""``deploykit validate --bundle``: a bundle replays the check with no deploykit, and its command
lines are ones the tools take (Polygraphy's own parser; trtexec's documented flags)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.validation.bundle import BUNDLE_FILE, REPLAY_SCRIPT, TRTEXEC_ALGORITHMS, TRTEXEC_FLAGS

RESOLUTIONS = (32, 48)  # as zoo_ape_export exported them

# Polygraphy reads its plugin entry points through a deprecated importlib interface; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:SelectableGroups dict interface:DeprecationWarning")


@pytest.fixture(scope="module")
def bundle(zoo_ape_export, tmp_path_factory) -> Path:
    """``deploykit validate --bundle`` on the export (4 noise + 4 real inputs per resolution)."""
    from deploykit.cli import main

    dest = tmp_path_factory.mktemp("bundle-out") / "bundle"
    try:
        main(["validate", str(zoo_ape_export), "--num-random", "4", "--num-real", "4", "--bundle", str(dest)])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"validate --bundle failed with {exit_.code}"
    return dest


def _commands(bundle: Path, tool: str) -> list[list[str]]:
    return [shlex.split(c) for c in json.loads((bundle / BUNDLE_FILE).read_text())["commands"] if c.startswith(tool + " ")]


def _bare_replay(bundle: Path) -> subprocess.CompletedProcess:
    """Run ``replay_ort.py`` in an interpreter that cannot import deploykit: isolated (``-I``: no
    working directory or PYTHONPATH on the path) and without site initialisation (``-S``: the
    editable install's path hook is never set up), with only onnxruntime's and numpy's directories
    on its path. It asserts that deploykit is unimportable before replaying."""
    import numpy
    import onnxruntime

    dirs = sorted({str(Path(m.__file__).parents[1]) for m in (numpy, onnxruntime)})
    code = (
        "import importlib.util, runpy, sys\n"
        f"sys.path[:0] = {dirs!r}\n"
        "assert importlib.util.find_spec('deploykit') is None, 'deploykit importable'\n"
        f"sys.argv = [{REPLAY_SCRIPT!r}, {str(bundle)!r}]\n"
        f"runpy.run_path({str(bundle / REPLAY_SCRIPT)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=bundle, capture_output=True, text=True, timeout=300)


def test_bundle_replays_without_deploykit(bundle):
    result = _bare_replay(bundle)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if line.startswith("PASS")]
    assert [line.split()[1] for line in passed] == [f"model_{r}.onnx" for r in RESOLUTIONS]


def test_a_passing_check_names_no_divergence(bundle):
    written = json.loads((bundle / BUNDLE_FILE).read_text())
    assert written["divergences"] == [] and not (bundle / "divergence").exists()
    assert all(r["first_divergent_layer"] is None and r["node_errors"] is None for r in written["report"])


def test_bare_replay_names_the_first_divergent_block(bundle, tmp_path):
    # A reference that leaves the tolerance from block 2 on (and in the logits): the replay fails
    # and names blocks.2, found by running the graph with its block outputs marked.
    planted = tmp_path / "planted"
    shutil.copytree(bundle, planted)
    check = json.loads((planted / BUNDLE_FILE).read_text())["checks"][1]
    blocks_file = planted / check["blocks"]["reference"]
    blocks = dict(np.load(blocks_file))
    for name in ("blocks.2", "blocks.3"):
        blocks[name] = blocks[name] + 0.5
    np.savez(blocks_file, **blocks)
    logits_file = planted / check["outputs"]["logits"]["npy"]
    np.save(logits_file, np.load(logits_file) + 0.5)
    result = _bare_replay(planted)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FAIL {check['graph']} logits" in result.stdout
    assert "first divergent block: blocks.2 " in result.stdout


def test_polygraphy_parser_takes_the_commands(bundle):
    from polygraphy.tools._main import main as polygraphy_main

    commands = _commands(bundle, "polygraphy")
    # per graph: against the reference with TensorRT, with ONNX Runtime, then TensorRT against ONNX Runtime layer by layer
    assert [c[3:5] for c in commands] == [["--trt", "--strongly-typed"], ["--onnxrt", "--input-shapes"], ["--trt", "--strongly-typed"]] * 2
    for argv in commands:
        args = _polygraphy_parse(argv[1:])
        assert args.load_inputs_paths and all((bundle / p).is_file() for p in args.load_inputs_paths)
        if "--onnxrt" in argv and "--trt" in argv:
            assert args.trt_outputs == ["*"] and args.onnx_outputs == ["*"] and args.fail_fast
        else:
            assert args.load_outputs_paths and all((bundle / p).is_file() for p in args.load_outputs_paths)
    # The ONNX Runtime line runs here: Polygraphy reads the inputs and reference it was given and passes.
    for argv in (c for c in commands if "--onnxrt" in c and "--trt" not in c):
        assert _in(bundle, lambda argv=argv: polygraphy_main(argv[1:])) == 0


def test_polygraphy_fails_a_wrong_reference(bundle, tmp_path):
    from polygraphy.comparator import RunResults
    from polygraphy.tools._main import main as polygraphy_main

    planted = tmp_path / "planted"
    shutil.copytree(bundle, planted)
    argv = next(c for c in _commands(planted, "polygraphy") if "--onnxrt" in c and "--trt" not in c)
    reference_file = planted / argv[argv.index("--load-outputs") + 1]
    results = RunResults.load(str(reference_file))
    ((_, iterations),) = results.items()
    iterations[0]["logits"] = iterations[0]["logits"] + 1e-3  # ten times the fp32 plan's max abs bar
    results.save(str(reference_file))
    assert _in(planted, lambda: polygraphy_main(argv[1:])) == 1


def _polygraphy_parse(argv: list[str]):
    """Parse as ``polygraphy`` does (its tool registry's parsers), refusing unknown options."""
    import argparse

    from polygraphy.tools.registry import TOOL_REGISTRY

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="tools", required=True)
    for tool in TOOL_REGISTRY:
        tool.setup_parser(subparsers)
    args, unknown = parser.parse_known_args(argv)
    assert not unknown, f"Polygraphy does not know {unknown}"
    args.subcommand.parse(args)
    return args


def _in(directory: Path, call):
    import os

    before = os.getcwd()
    os.chdir(directory)
    try:
        return call()
    finally:
        os.chdir(before)


def test_trtexec_commands_use_documented_flags_and_files(bundle):
    manifest = json.loads((bundle / BUNDLE_FILE).read_text())
    tolerance = manifest["tolerance"]
    commands = _commands(bundle, "trtexec")
    assert len(commands) == 2 * len(RESOLUTIONS)  # max abs (lInf), then cosine
    for argv in commands:
        flags = dict(arg.split("=", 1) if "=" in arg else (arg, "") for arg in argv[1:])
        assert set(flags) <= set(TRTEXEC_FLAGS), set(flags) - set(TRTEXEC_FLAGS)
        assert flags["--accuracyAlgorithm"] in TRTEXEC_ALGORITHMS
        expected = tolerance["max_abs"] if flags["--accuracyAlgorithm"] == "lInf" else 1 - tolerance["min_cosine"]
        assert float(flags["--accuracyThreshold"]) == pytest.approx(expected, rel=1e-5)
        check = next(c for c in manifest["checks"] if c["graph"] == flags["--onnx"])
        # name:file pairs whose raw files hold exactly the tensors the check ran, in C order
        for flag, tensors in (("--loadInputs", check["inputs"]), ("--loadRefOutputs", check["outputs"])):
            name, raw = flags[flag].split(":", 1)
            files = tensors[name]
            data = np.fromfile(bundle / raw, dtype=files["dtype"]).reshape(files["shape"])
            np.testing.assert_array_equal(data, np.load(bundle / files["npy"]).astype(files["dtype"]))
        in_name, files = next(iter(check["inputs"].items()))
        assert flags["--shapes"] == f"{in_name}:" + "x".join(map(str, files["shape"]))


def test_bundle_records_tolerance_report_and_environment(bundle):
    from deploykit.export.precision import PLANS

    manifest = json.loads((bundle / BUNDLE_FILE).read_text())
    assert manifest["tolerance"] == PLANS["fp32"].tolerance.to_dict()
    assert [r["resolution"] for r in manifest["report"]] == [[r, r] for r in RESOLUTIONS]
    assert manifest["environment"]["versions"]["onnxruntime"]
    assert (bundle / "commands.sh").read_text().count("\ntrtexec ") == 2 * len(RESOLUTIONS)
    for check in manifest["checks"]:  # each ONNX node (what TensorRT names layers after) with its module
        nodes = json.loads((bundle / Path(check["polygraphy_inputs"]).parent / "nodes.json").read_text())
        assert {"blocks.0.attn", "head"} <= {n["module"] for n in nodes}


def test_existing_directory_that_is_not_a_bundle_is_refused(zoo_ape_export, tmp_path, deploykit_cli):
    dest = tmp_path / "notes"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    code, err = deploykit_cli("validate", zoo_ape_export, "--num-random", "1", "--num-real", "0", "--bundle", dest)
    assert code == 1
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --bundle {dest} exists and is not a validate bundle; give a new or empty directory"
    ]
    assert sorted(p.name for p in dest.iterdir()) == ["mine.txt"]

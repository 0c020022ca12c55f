"""The torch-free catalog ``deploykit list`` prints is the registries' content, and the commands
that only read or write files do not import PyTorch."""

import json
import subprocess
import sys
from pathlib import Path

from deploykit import catalog
from deploykit.encodings import list_encodings
from deploykit.nn import list_models


def test_catalog_names_every_registered_encoding_and_model():
    """Read from the source, the names are what importing the registries registers."""
    assert catalog.encodings() == list_encodings()
    assert catalog.models() == list_models()


def test_catalog_reads_a_new_registration_and_size(tmp_path, monkeypatch):
    """A name added where encodings and sizes are defined is listed with nothing else edited."""
    for relative in ["encodings/ape.py", "nn/vit.py", "nn/sequence.py"]:
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_text((Path(catalog.__file__).parent / relative).read_text())
    extra = tmp_path / "encodings" / "extra.py"
    extra.write_text('@register_encoding("extra-pe", ExtraConfig, variant={"mode": "x"})\nclass Extra:\n    pass\n')
    vit = tmp_path / "nn" / "vit.py"
    vit.write_text(
        vit.read_text().replace(
            "MODEL_CONFIGS: dict[str, dict[str, Any]] = {", 'MODEL_CONFIGS: dict[str, dict[str, Any]] = {\n    "vit_huge": {},', 1
        )
    )
    monkeypatch.setattr(catalog, "_PACKAGE", tmp_path)
    assert catalog.encodings() == ["ape", "extra-pe"]
    assert "vit_huge" in catalog.models() and "char_gpt_ega" in catalog.models()


def _modules_after(args: list[str]) -> tuple[int, str, set[str]]:
    """Run ``deploykit ARGS`` in a fresh interpreter; its exit code, output and imported modules."""
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from deploykit.cli import cli\n"
        f"result = CliRunner().invoke(cli, {args!r})\n"
        "print(json.dumps([result.exit_code, result.output, sorted(sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    exit_code, output, modules = json.loads(out.splitlines()[-1])
    return exit_code, output, set(modules)


HEAVY = ("torch", "onnxscript", "onnxruntime")


def test_list_imports_no_torch():
    exit_code, output, modules = _modules_after(["list"])
    assert exit_code == 0 and "rope-mixed" in output
    assert not [m for m in HEAVY if m in modules], output


def test_package_triton_imports_no_torch(good_export, tmp_path):
    exit_code, output, modules = _modules_after(["package", "triton", str(good_export), "-o", str(tmp_path / "repo")])
    assert exit_code == 0, output
    assert (tmp_path / "repo" / "README.md").is_file()
    # The OpenVINO model's graph is prepared by OpenVINO's rule set (deploykit.graph.openvino), which
    # runs on onnxscript's rewriter; PyTorch and ONNX Runtime stay out.
    assert not [m for m in HEAVY if m in modules and m != "onnxscript"], output
    assert "deploykit.graph.openvino" in modules

"""The torch-free catalog ``deploykit list`` prints is the registries' content, and the commands
that only read or write files do not import PyTorch."""

import json
import subprocess
import sys

from deploykit import catalog
from deploykit.encodings import list_encodings
from deploykit.nn import list_models


def test_catalog_names_every_registered_encoding_and_model():
    assert list(catalog.ENCODINGS) == list_encodings()
    assert list(catalog.MODELS) == list_models()


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
    assert not [m for m in HEAVY if m in modules], output

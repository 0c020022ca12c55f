"""``deploykit profile`` on engine backends: only engines that ``deploykit build`` wrote are
timed; what is missing (the in-memory APE baseline, an engine not built, no GPU) is a note in
the report, not a traceback; every record says what ran it and whether CUDA graphs were used."""

from __future__ import annotations

import json

import onnxruntime
import pytest
import torch

from deploykit.export import export
from deploykit.nn import create_model
from deploykit.profile import Budget, Subject, profile
from deploykit.runners.base import CudaGraphUse, RunInfo
from deploykit.runners.onnxrt import OnnxrtRunner
from tests.test_cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
TINY_BUDGET = Budget(iterations=2, warmup=1)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("profile-engines") / "exp"
    export(create_model("vit_tiny_patch16", encoding="rope-axial", depth=1, img_size=32, num_classes=10), [(32, 32), (48, 48)], out)
    return out


@pytest.mark.slow
def test_cli_profile_on_rtx_notes_what_it_cannot_time(export_dir, tmp_path, capsys):
    """The README's ``deploykit profile DIR --backend rtx`` crashed (the APE twin's in-memory graph
    reached the engine runner as bytes). Engines built at 32 only; no GPU here."""
    from deploykit.backends.build import build

    build(export_dir, "rtx", resolutions=[(32, 32)], optimization_level=0)
    code, stdout, stderr = run_cli(
        capsys,
        "profile",
        export_dir,
        "--backend",
        "ort,rtx",
        "--iterations",
        1,
        "--warmup",
        0,
        "--no-end-to-end",
        "--json",
        tmp_path / "p.json",
    )
    assert code == 0, stderr
    report = json.loads((tmp_path / "p.json").read_text())
    assert {(r["backend"], r["encoding"]) for r in report["records"]} == {("ort", "rope-axial"), ("ort", "ape")}
    notes = report["notes"]
    assert (
        "ape on rtx @ 32: not profiled: the APE baseline is exported by profile into a temporary directory, so no engine was built for it"
        in notes
    )
    assert any(n.startswith("rope-axial on rtx @ 48: not profiled: no rtx engine for model_48.onnx; run: deploykit build") for n in notes)
    if not torch.cuda.is_available():
        assert any(n.startswith("rope-axial on rtx @ 32: not profiled: the rtx runner needs a CUDA GPU") for n in notes)
    assert all(f"note: {n}" in stderr for n in notes) and "Traceback" not in stderr
    code, _, stderr = run_cli(
        capsys, "-q", "profile", export_dir, "--backend", "rtx", "--resolution", "48", "--iterations", 1
    )  # -q: no step lines
    assert code == 1 and stderr.startswith("error: nothing was profiled: ") and len(stderr.strip().splitlines()) == 1


class _StandInEngine(OnnxrtRunner):
    """An engine backend's runner with ONNX Runtime underneath; records what profile gave it."""

    given: list = []

    def __init__(self, onnx_path, plugins, cuda_graph):
        super().__init__(onnx_path)
        self.cuda_graph = cuda_graph
        _StandInEngine.given.append(onnx_path)

    @property
    def info(self):
        return RunInfo("stand-in engine", cuda_graphs=CudaGraphUse(self.cuda_graph, ""))


@pytest.mark.slow
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_engine_backend_gets_the_export_s_graph_and_records_cuda_graph_use(export_dir, stand_in_backend, cuda_graphs):
    stand_in_backend("rtx", lambda path, options: _StandInEngine(path, options.plugins, options.cuda_graph))
    _StandInEngine.given = []
    result = profile(
        Subject.from_export_dir(export_dir),
        resolutions=[(32, 32)],
        backends=["ort", "rtx"],
        budget=TINY_BUDGET,
        end_to_end=False,
        device="cpu",
        cuda_graphs=cuda_graphs,
    )
    assert _StandInEngine.given == [export_dir / "model_32.onnx"]  # the export's own graph; never the APE twin's
    by_key = {(r.backend, r.encoding): r for r in result.records}
    assert set(by_key) == {("ort", "rope-axial"), ("ort", "ape"), ("rtx", "rope-axial")}
    assert by_key["rtx", "rope-axial"].run["cuda_graph"] is cuda_graphs and by_key["rtx", "rope-axial"].ratio_vs_ape is None
    assert by_key["ort", "ape"].run["provider"] in onnxruntime.get_available_providers()
    assert result.notes == [
        "ape on rtx @ 32: not profiled: the APE baseline is exported by profile into a temporary directory, so no engine was built for it"
    ]


def test_torch_records_say_what_ran(export_dir):
    result = profile(
        Subject.from_export_dir(export_dir), resolutions=[(32, 32)], backends=["torch"], budget=TINY_BUDGET, end_to_end=False, device="cpu"
    )
    assert {r.run["provider"] for r in result.records} == {f"torch {torch.__version__} cpu float32"} and result.notes == []

"""``deploykit import mope``: the MoPE repository's checkpoints give its own logits, in PyTorch
(≤ 1e-5) and exported to ONNX Runtime (≤ 1e-4), at every length from 1 to the block size; files
of another kind and ``--ema`` are refused in one line.

The checkpoints and logits are the official code's (``record_mope.py``: its GPT at a tiny size,
saved by its own training loop); these tests read only them, never the repository.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from deploykit.cli.importers import get_importer
from deploykit.errors import CheckpointError
from deploykit.export import export
from deploykit.nn import create_model, load_model
from deploykit.nn.checkpoint import read_training_checkpoint
from deploykit.nn.from_mope import convert
from deploykit.runners.onnxrt import OnnxrtRunner
from tests.test_cli import assert_one_line_error, run_cli

# torch.onnx's dynamo exporter trips a deprecation inside torch.utils._pytree; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
DATA = Path(__file__).with_name("data") / "mope"
REFERENCE = json.loads((DATA / "reference.json").read_text())
SIZES = REFERENCE["sizes"]
BLOCK_SIZE = SIZES["BLOCK_SIZE"]
LENGTHS = range(1, BLOCK_SIZE + 1)
TOKENS = np.array(REFERENCE["tokens"], dtype=np.int64)  # [2, BLOCK_SIZE]; a length T reads [:, :T]
VARIANTS = REFERENCE["variants"]  # the script's save name -> its label, classes and logits per length
HEADLINE = "exp2_egam"  # EGA-MORLET
# The script's class names, as deploykit's config calls them.
ATTENTIONS = {"EGA1Attention": "ega", "DotProductAttention": "dot"}
ENCODINGS = {"MorletPE": "mope", None: "ape"}


def official_logits(name: str, length: int) -> torch.Tensor:
    return torch.tensor(VARIANTS[name]["logits"][str(length)])


def checkpoint_path(name: str) -> Path:
    return DATA / VARIANTS[name]["checkpoint"]


@pytest.fixture(scope="module")
def imported():
    """Save name -> ``Imported``, through the importer table as the CLI calls it."""
    return {name: get_importer("mope").convert(checkpoint_path(name)) for name in VARIANTS}


@pytest.mark.parametrize("name", VARIANTS)
def test_reads_the_model_from_the_file(imported, name):
    variant = VARIANTS[name]
    saved = torch.load(checkpoint_path(name), map_location="cpu", weights_only=True)
    assert set(saved) == {"model_state", "optimizer_state", "history", "step"}  # as the script saves
    assert imported[name].read == dict(
        model=variant["label"],
        depth=SIZES["N_LAYER"],
        heads=SIZES["N_HEAD"],
        embed_dim=SIZES["N_EMBED"],
        vocab=SIZES["VOCAB"],
        block_size=BLOCK_SIZE,
        attention=ATTENTIONS[variant["attention"]],
        encoding=ENCODINGS[variant["encoding"]],
        step=saved["step"],
    )
    assert imported[name].assumed == {}  # the file holds everything the forward needs
    cfg = imported[name].model.cfg
    assert (cfg.causal, cfg.qkv_bias, cfg.mlp_ratio) == (True, False, 4.0)


def test_mope_constants_are_the_scripts():
    """MorletPE.forward: ω capped at 0.95π, σ floored at 1e-3, ω ← 5/σ, envelope term 1e-8, b from 0."""
    encoding = convert(read_training_checkpoint(checkpoint_path(HEADLINE))).model.cfg.encoding
    assert (encoding.omega_cap, encoding.sigma_floor, encoding.admissibility, encoding.envelope_eps) == (0.95 * math.pi, 1e-3, 5.0, 1e-8)
    assert (encoding.clamp_grad, encoding.origin) == ("hard", "corner")


@pytest.mark.parametrize("name", VARIANTS)
def test_pytorch_equals_the_official_logits_at_every_length(imported, name):
    model = imported[name].model
    for length in LENGTHS:
        with torch.no_grad():
            logits = model(torch.from_numpy(TOKENS[:, :length]))
        expected = official_logits(name, length)
        assert expected.abs().max() > 0.1  # a real signal
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_onnx_runtime_equals_the_official_logits(imported, tmp_path, name):
    """Every length for the headline EGA-MORLET; the shortest and the longest for the others."""
    lengths = list(LENGTHS) if name == HEADLINE else [1, BLOCK_SIZE]
    manifest = export(imported[name].model, [(t,) for t in lengths], tmp_path)
    for length in lengths:
        with OnnxrtRunner(tmp_path / manifest.graph((length,)).file) as runner:
            logits = runner.infer({"tokens": TOKENS[:, :length]})["logits"]
        np.testing.assert_allclose(logits, official_logits(name, length).numpy(), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# refusals: one line, naming the first key that does not fit and what was expected


def _edited(edit) -> dict:
    weights = dict(read_training_checkpoint(checkpoint_path(HEADLINE)).weights)
    edit(weights)
    return weights


def _renamed(state: dict, old: str, new: str) -> None:
    for key in [k for k in state if k.startswith(old)]:
        state[new + key.removeprefix(old)] = state.pop(key)


def _without(*keys: str):
    def edit(state: dict) -> None:
        for key in keys:
            del state[key]

    return edit


def _with(key: str, value: torch.Tensor):
    return lambda state: state.__setitem__(key, value)


REFUSED = {
    "PE-SINCOS": (
        lambda s: (
            _without("pe.log_omega", "pe.log_sigma", "pe.pos")(s),
            s.__setitem__("pe.pe", torch.zeros(BLOCK_SIZE, SIZES["N_EMBED"])),
        ),
        ("pe.pe", "PE-SINCOS", "EGA-MORLET"),
    ),
    "PE-ROPE": (_with("blocks.0.heads.0.theta", torch.ones(2)), ("blocks.0.heads.0.theta", "PE-ROPE")),
    "CONV-L4": (_with("blocks.1.heads.2.lag_weights", torch.zeros(9)), ("blocks.1.heads.2.lag_weights", "CONV-L4")),
    "foreign key": (_with("blocks.0.attn.qkv.weight", torch.zeros(1)), ("'blocks.0.attn.qkv.weight'", "expected tok_emb.weight")),
    "untied head": (lambda s: s.__setitem__("head.weight", s["head.weight"] + 0.1), ("head.weight", "tok_emb.weight")),
    "missing head weight": (_without("blocks.1.heads.2.value.weight"), ("no blocks.1.heads.2.value.weight",)),
    "half an EGA head": (_without("blocks.1.heads.1.alpha"), ("no blocks.1.heads.1.alpha",)),
    "extra head": (_with("blocks.1.heads.3.query.weight", torch.zeros(4, SIZES["N_EMBED"])), ("blocks.1.heads.3.query.weight", "3 heads")),
    "block gap": (lambda s: _renamed(s, "blocks.1.", "blocks.2."), ("no blocks.1 but has blocks.2",)),
    "wrong shape": (lambda s: s.__setitem__("pe.log_sigma", s["pe.log_sigma"][:2]), ("pe.log_sigma has shape (2,)", "expected shape (6,)")),
    "not causal": (
        lambda s: s.__setitem__("blocks.0.heads.1.tril", torch.ones(BLOCK_SIZE, BLOCK_SIZE)),
        ("blocks.0.heads.1.tril", "causal"),
    ),
    "no position": (_without("pe.log_omega", "pe.log_sigma", "pe.pos"), ("neither pe.log_omega", "pos_emb.weight")),
}


@pytest.mark.parametrize("case", REFUSED)
def test_other_files_are_refused_in_one_line(case):
    edit, needles = REFUSED[case]
    checkpoint = dataclasses.replace(read_training_checkpoint(checkpoint_path(HEADLINE)), weights=_edited(edit))
    with pytest.raises(CheckpointError) as caught:
        convert(checkpoint)
    message = str(caught.value)
    assert "\n" not in message and str(checkpoint.path) in message
    for needle in needles:
        assert needle in message, message


def test_another_models_file_is_refused_by_its_first_key(tmp_path):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in create_model("vit_tiny_patch16", depth=1).state_dict().items()}
    save_file(state, str(tmp_path / "vit.safetensors"))
    first = next(iter(read_training_checkpoint(tmp_path / "vit.safetensors").weights))  # safetensors sorts the names
    with pytest.raises(CheckpointError, match=f"its key '{first}' is not one it saves; expected tok_emb.weight"):
        get_importer("mope").convert(tmp_path / "vit.safetensors")


def test_ema_is_refused_in_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "import", "mope", checkpoint_path(HEADLINE), "--ema", "-o", tmp_path / "m")
    assert_one_line_error(code, err, "no EMA weights", "drop --ema")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_cli_import_export_int8_validate(capsys, tmp_path):
    """``import mope FILE -o DIR``, then ``export -c DIR`` (fp32 + int8) and ``validate`` both plans."""
    model_dir, out = tmp_path / "m", tmp_path / "out"
    code, _, err = run_cli(capsys, "import", "mope", checkpoint_path(HEADLINE), "-o", model_dir)
    assert code == 0 and "EGA-MORLET" in err, err
    with torch.no_grad():  # the saved directory is the official model
        logits = load_model(model_dir)(torch.from_numpy(TOKENS))
    torch.testing.assert_close(logits, official_logits(HEADLINE, BLOCK_SIZE), atol=1e-5, rtol=0)
    code, _, err = run_cli(
        capsys,
        "export",
        "-c",
        model_dir,
        "-r",
        1,
        "-r",
        BLOCK_SIZE,
        "--precision",
        "int8",
        "--calibration-samples",
        8,
        "--held-out",
        64,
        "-o",
        out,
    )
    assert code == 0, err
    for precision in ("fp32", "int8"):  # each plan at both lengths
        code, _, err = run_cli(capsys, "validate", out, "--precision", precision, "--num-random", 2, "--num-real", 2)
        assert code == 0 and "2/2 checks passed" in err, err

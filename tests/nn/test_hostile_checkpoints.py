"""Checkpoint files built to hurt, from allowed globals only: each is refused in one line before
anything is allocated from what it claims, with nothing written, and each comes with a control
proving that its payload is real (what a plain load gives, or what the importer would have read).

The files are small variants of the recorded GridPE and MoPE checkpoints (``record_gridpe.py``,
``record_mope.py``) and of a tiny timm-named ViT.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from record_gridpe import CHECKPOINT as GRIDPE

from deploykit._io import write_json_atomic
from deploykit.cli.importers import get_importer
from deploykit.errors import CheckpointError, DeployKitError
from deploykit.nn import create_model
from deploykit.nn.checkpoint import read_training_checkpoint
from deploykit.nn.from_mope import read_layout

pytestmark = pytest.mark.filterwarnings("ignore:GridPE scale ratio:UserWarning")
MOPE = Path(__file__).with_name("data") / "mope" / "exp2_egam.pt"

try:  # numpy 2 (numpy 1 names it numpy.core.multiarray), as a pickle names it
    from numpy._core.multiarray import scalar
except ImportError:
    from numpy.core.multiarray import scalar


def contents(path: Path) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def written(tmp_path: Path, obj, name: str = "hostile.pth") -> Path:
    torch.save(obj, tmp_path / name)
    return tmp_path / name


def refused(importer: str, path: Path, match: str) -> str:
    with pytest.raises(DeployKitError, match=match) as err:
        get_importer(importer).convert(path)
    assert "\n" not in str(err.value)
    return str(err.value)


# ----------------------------------------------------------------------------------------------
# What numpy builds from an allowed global: a flexible dtype's scalar is allocated whole from no data


class _Dtype:
    def __init__(self, spec: str):
        self.spec = spec

    def __reduce__(self):  # numpy.dtype(spec, False, True), as numpy pickles a dtype, with no BUILD
        return (np.dtype, (self.spec, False, True))


class _Scalar:
    def __init__(self, spec: str, *data):
        self.spec, self.data = spec, data

    def __reduce__(self):  # numpy's scalar reconstructor, given a dtype and no bytes
        return (scalar, (_Dtype(self.spec), *self.data))


@pytest.mark.parametrize(("spec", "data"), [("V16777216", ()), ("O", ("an object",))])
def test_a_numpy_scalar_of_a_flexible_or_object_dtype_is_refused(tmp_path, spec, data):
    path = written(tmp_path, {"model": {"w": torch.zeros(1)}, "best_acc": _Scalar(spec, *data)})
    assert path.stat().st_size < 4096
    if spec.startswith("V"):  # control: a plain load allocates the dtype's 16 MiB from a 2 KB file
        assert torch.load(path, weights_only=False)["best_acc"].nbytes == 1 << 24
    with pytest.raises(CheckpointError, match=r"numpy scalar of dtype .*deploykit reads numbers of at most 16 bytes") as err:
        read_training_checkpoint(path)
    assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)


def test_numpy_numbers_beside_the_weights_still_load(tmp_path):
    path = written(tmp_path, {"model": {"w": torch.zeros(1)}, "best_acc": np.float64(81.5), "seed": np.int64(0)})
    assert read_training_checkpoint(path).extras == {"best_acc": 81.5, "seed": 0}


def test_a_pickle_building_a_numpy_object_dtype_is_refused_without_torchs_advice(tmp_path):
    path = written(tmp_path, {"model": {"w": torch.zeros(1)}, "kind": np.dtype("O")})
    with pytest.raises(CheckpointError, match=r"it builds a numpy\.dtypes\.ObjectDType, which is not a weight") as err:
        read_training_checkpoint(path)
    assert "weights_only=False" not in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------
# Views: one stored value seen as a large matrix


def test_a_zero_stride_table_is_refused_before_mope_builds_a_mask_of_its_size(tmp_path):
    side = 4096  # the attack used 46341: an 8.6 GB torch.ones per block
    state = contents(MOPE)["model_state"]
    for key in [k for k in state if k.endswith(".tril")]:
        state[key] = torch.ones(1, 1).expand(side, side)
    state["pe.pos"] = torch.arange(side)
    path = written(tmp_path, {"model_state": state, "step": 2})
    # Control: the file is small, torch loads the views, and the importer reads its sizes off them.
    loaded = contents(path)["model_state"]
    assert path.stat().st_size < 1 << 20 and loaded["blocks.0.heads.0.tril"].shape == (side, side)
    assert read_layout(loaded, str(path)).context == side
    refused("mope", path, r"its tensors describe [\d,]+ bytes but the file holds [\d,]+: views repeating stored values")


def test_a_view_within_the_bound_is_materialised_so_no_two_names_share_values(tmp_path):
    shared = torch.arange(6.0)
    path = written(tmp_path, {"a": shared.expand(2, 6), "b": shared})
    weights = read_training_checkpoint(path).weights
    assert weights["a"].is_contiguous() and weights["a"].stride() == (6, 1)
    weights["a"][0, 0] = 100.0
    assert weights["b"][0] == 0.0


# ----------------------------------------------------------------------------------------------
# Block numbers: the count is bounded by the keys present


def _tiny_vit_state() -> dict:
    return create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=3).state_dict()


def test_one_far_block_key_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    built = []
    import deploykit.nn.checkpoint as checkpoint

    real = checkpoint.build_model
    monkeypatch.setattr(checkpoint, "build_model", lambda cfg: built.append(cfg.depth) or real(cfg))
    # Control: the same file without the far key imports, building (meta, then real) a 1-block model.
    get_importer("vit").convert(written(tmp_path, _tiny_vit_state(), "plain.pth"), model="vit_tiny_patch16")
    assert built == [1, 1]
    built.clear()
    state = {**_tiny_vit_state(), "blocks.1000.norm1.weight": torch.ones(192)}
    with pytest.raises(CheckpointError, match=r"has no blocks\.1\.\* but has blocks\.1,000\.\*"):
        get_importer("vit").convert(written(tmp_path, state), model="vit_tiny_patch16")
    assert built == []  # main built 1,001 blocks (2 GB, 51 s) before "does not fit"


@pytest.mark.parametrize("key", ["blocks.99999999.norm1.weight", "blocks.abc.norm1.weight", "blocks.01.norm1.weight"])
def test_gridpe_block_numbers_are_bounded_by_the_keys(tmp_path, key):
    file = contents(GRIDPE)
    file["model"][key] = torch.ones(48)
    refused("gridpe", written(tmp_path, file), r"is not a GridPE DeiT checkpoint.*the blocks are not numbered 0 to depth-1")


# ----------------------------------------------------------------------------------------------
# GridPE's args, sizes and values


def _args(**changes):
    def change(file):
        for name, value in changes.items():
            setattr(file["args"], name, value(file["args"]) if callable(value) else value)

    return change


def _state(edit):
    def change(file):
        edit(file["model"])

    return change


def _set(key, value):
    return _state(lambda state: state.__setitem__(key, value(state[key])))


HOSTILE = {
    "input_size a path": (_args(input_size=Path("/etc/passwd")), r"args\.input_size is PosixPath; main\.py's parser gives an integer"),
    "input_size a string": (_args(input_size="224"), r"args\.input_size is '224'"),
    "input_size a list": (_args(input_size=[224, 224]), r"args\.input_size is \[224, 224\]"),
    "eval_crop_ratio NaN": (_args(eval_crop_ratio=math.nan), r"args\.eval_crop_ratio is nan; main\.py's parser gives a number \(finite\)"),
    "nb_classes the args themselves": (_args(nb_classes=lambda args: args), r"args\.nb_classes is Namespace"),
    "model a number": (_args(model=5), r"args\.model is 5"),
    "width 0": (
        _state(lambda s: s.update({"cls_token": torch.zeros(1, 1, 0), "patch_embed.proj.weight": torch.zeros(0, 3, 16, 16)})),
        r"cls_token has shape \[1, 1, 0\]; expected 3 non-empty dimensions",
    ),
    "0-d head": (_set("head.weight", lambda t: torch.tensor(1.0)), r"head\.weight has shape \[\]; expected 2 non-empty dimensions"),
    "0-d cls_token": (_set("cls_token", lambda t: torch.tensor(1.0)), r"cls_token has shape \[\]"),
    "NaN weights": (_set("head.weight", lambda t: torch.full_like(t, math.nan)), r"head\.weight holds [\d,]+ NaN or infinite values"),
    "Inf weights": (
        _set("blocks.1.mlp.fc2.weight", lambda t: t.index_fill(0, torch.tensor([0]), math.inf)),
        r"blocks\.1\.mlp\.fc2\.weight holds",
    ),
    "int64 weights": (
        _set("blocks.0.mlp.fc1.weight", lambda t: t.long()),
        r"blocks\.0\.mlp\.fc1\.weight holds torch\.int64 values; a weight is floating",
    ),
    "complex omegas": (
        _set("blocks.1.attn.grid_pe.omegas", lambda t: t.to(torch.complex64)),
        r"blocks\.1\.attn\.grid_pe\.omegas holds complex",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_gridpe_files_are_refused_in_one_line_naming_the_value(tmp_path, case):
    change, expected = HOSTILE[case]
    file = contents(GRIDPE)
    file["args"] = argparse.Namespace(**vars(file["args"]))
    change(file)
    refused("gridpe", written(tmp_path, file), expected)


def test_an_epoch_that_is_no_number_is_not_read_and_the_import_writes_whole_files(tmp_path, deploykit_cli):
    file = contents(GRIDPE)
    epoch: list = []
    for _ in range(3000):
        epoch = [epoch]
    file["epoch"] = epoch
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # the pickler recurses once per level, as the attacker's did not need to
    try:
        path = written(tmp_path, file)
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(contents(path)["epoch"], list)  # control: the nesting survives a weights-only load
    code, out = deploykit_cli("import", "gridpe", path, "-o", tmp_path / "out")
    assert code == 0, out
    assert "epoch" not in out.rpartition("  (")[2] and sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


# ----------------------------------------------------------------------------------------------
# From the command line: one error: line each


class _System:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_calling_os_system_is_refused_in_one_line_without_torchs_advice(tmp_path, deploykit_cli):
    marker = tmp_path / "code-ran"
    path = written(tmp_path, {"model": create_model("vit_tiny_patch16", depth=1).state_dict(), "hook": _System(marker)}, "evil.pth")
    torch.load(path, weights_only=False)  # control: a plain load runs the command
    assert marker.exists()
    marker.unlink()
    write_json_atomic(tmp_path / "config.json", create_model("vit_tiny_patch16", depth=1).cfg.to_dict())
    code, err = deploykit_cli("export", "--checkpoint", path, "-o", tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: ")
    assert "Unsupported global: posix.system (loading it would run code" in err or "Unsupported global: nt.system" in err
    assert "weights_only=False" not in err and not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_special_file_as_the_weights_is_named_for_what_it_is(tmp_path, kind):
    path = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(kind)
    expected = "a FIFO" if kind == "fifo" else "a character device"
    with pytest.raises(CheckpointError, match=rf"^checkpoint .*model\.safetensors is {expected}, not a regular file"):
        read_training_checkpoint(path)


def test_a_long_model_kwargs_literal_is_refused_in_one_line(deploykit_cli):
    from deploykit.nn.from_timm import parse_model_kwargs

    negated = "-" * 127_999 + "1"
    with pytest.raises(MemoryError):  # control: the literal reader fails inside itself (no ValueError or SyntaxError)
        ast.literal_eval(negated)
    with pytest.raises(
        DeployKitError,
        match=r"^--model-kwargs img_size= has a value of 128,000 characters; timm.s arguments are short literals \(at most 1,024\)",
    ):
        parse_model_kwargs([f"img_size={negated}"])


# ----------------------------------------------------------------------------------------------
# Tensors that store no values, or values no CPU arithmetic reads (found by test_checkpoint_fuzz.py)

TENSORS_OF_NO_WEIGHT = {
    "meta": (lambda: torch.empty(192, device="meta"), r"is a tensor on the meta device \(no values stored\)"),
    "sparse": (lambda: torch.zeros(192).to_sparse(), r"is a sparse_coo tensor"),
    "sparse CSR": (lambda: torch.zeros(3, 64).to_sparse_csr(), r"is a sparse_csr tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(1)]), r"is a nested tensor"),
    "float8": (lambda: torch.zeros(192, dtype=torch.float8_e4m3fn), r"is of dtype torch\.float8_e4m3fn"),
}


@pytest.mark.parametrize("kind", TENSORS_OF_NO_WEIGHT)
def test_a_tensor_storing_no_plain_values_is_refused_by_name(tmp_path, kind):
    make, expected = TENSORS_OF_NO_WEIGHT[kind]
    state = {**_tiny_vit_state(), "norm.bias": make()}
    path = written(tmp_path, state)
    loaded, made = contents(path)["norm.bias"], make()  # control: torch's weights-only load rebuilds it as it was
    assert (loaded.layout, loaded.is_nested, loaded.device, loaded.dtype) == (made.layout, made.is_nested, made.device, made.dtype)
    with pytest.raises(CheckpointError, match=rf"norm\.bias {expected}; a weight is a dense tensor of numbers") as err:
        get_importer("vit").convert(path, model="vit_tiny_patch16")  # main: RuntimeError/NotImplementedError
    assert "\n" not in str(err.value)


def test_a_float8_weight_in_a_safetensors_file_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    save_file({**_tiny_vit_state(), "norm.bias": torch.zeros(192, dtype=torch.float8_e4m3fn)}, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match=r"norm\.bias is of dtype torch\.float8_e4m3fn"):
        get_importer("vit").convert(tmp_path / "w.safetensors", model="vit_tiny_patch16")


@pytest.mark.parametrize("name", ["x" * 100_000, "head.weight\nerror: not this"])
def test_a_weight_name_too_long_or_not_printable_is_refused_in_one_short_line(tmp_path, name):
    state = {**_tiny_vit_state(), name: torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"a weight is named .* characters\); weight names are printable and at most 1,024") as err:
        get_importer("vit").convert(written(tmp_path, state), model="vit_tiny_patch16")
    assert "\n" not in str(err.value) and len(str(err.value)) < 400  # main: the name whole in the message

"""``deploykit import gridpe``: BoyangL1/Gridpe's ``best_checkpoint.pth``, read as ``main.py`` saves
it, gives the official model's outputs: in PyTorch within 1e-5 and, exported, in ONNX Runtime
within 1e-4, at every input size the paper evaluates (160 to 512) and a non-square one, for the
trained and (``--ema``) the EMA weights; what is not such a checkpoint is refused in one line.

The checkpoint and the official outputs are recorded by ``record_gridpe.py`` from the official
code (a tiny seeded ``gridpe_deit_small_patch16_LS``: width 48, 2 blocks, 2 heads, 10 classes),
so these tests need neither the repository nor timm.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
import pytest
import torch
from record_gridpe import CHECKPOINT, FIXTURE
from timm_reference import probe_images, tag

from deploykit.cli.importers import get_importer
from deploykit.errors import CheckpointError, ConfigError
from deploykit.export import export, lint_graph
from deploykit.nn import load_model
from deploykit.nn.from_gridpe import IMAGENET_MEAN, IMAGENET_STD
from deploykit.runners.onnxrt import OnnxrtRunner

pytestmark = [
    # The official base 10000 exceeds the paper's bound on the scale ratio (spec A1/A2): the warning is GridPE's own.
    pytest.mark.filterwarnings("ignore:GridPE scale ratio:UserWarning"),
    # torch.onnx's dynamo exporter trips a deprecation inside torch.utils._pytree; not ours to fix.
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]
REFERENCE = json.loads(FIXTURE.read_text())
RESOLUTIONS = [tuple(r) for r in REFERENCE["resolutions"]]
NON_SQUARE = next(r for r in RESOLUTIONS if r[0] != r[1])


def imported(path=CHECKPOINT, ema=False, options=()):
    return get_importer("gridpe").convert(path, ema, options)


def official(weights: str, resolution) -> torch.Tensor:
    return torch.tensor(REFERENCE["outputs"][weights][tag(resolution)])


def saved(path) -> dict:
    """A checkpoint file's contents, read as main.py reads them (its Namespace allowed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def rewritten(tmp_path, change, name="changed.pth"):
    """The recorded checkpoint, changed by ``change(contents)`` (which may return a replacement), saved anew."""
    contents = saved(CHECKPOINT)
    replaced = change(contents)
    path = tmp_path / name
    torch.save(contents if replaced is None else replaced, path)
    return path


@pytest.fixture(scope="module")
def model():
    return imported().model


def test_the_recording_is_a_checkpoint_as_main_py_saves_it():
    contents = saved(CHECKPOINT)
    assert list(contents) == ["model", "optimizer", "lr_scheduler", "epoch", "model_ema", "scaler", "args"]
    assert isinstance(contents["args"], argparse.Namespace) and contents["args"].model == "gridpe_deit_small_patch16_LS"
    assert contents["optimizer"]["state"], "the optimizer's state holds tensors, as after an epoch"
    assert REFERENCE["repository"] == "BoyangL1/Gridpe" and REFERENCE["checkpoint"] == CHECKPOINT.name


def test_everything_is_read_from_the_file(model):
    result = imported()
    assert result.read == {
        "model": "gridpe_deit_small_patch16_LS",
        "epoch": 0,
        "weights": "model",
        "depth": 2,
        "heads": 2,
        "embed_dim": 48,
        "patch_size": 16,
        "classes": 10,
        "input_size": 224,
        "eval_crop_ratio": 1.0,
    }
    assert result.assumed == {} and "assumed" not in result.describe()
    cfg = model.cfg
    assert (cfg.img_size, cfg.patch_size, cfg.in_chans, cfg.num_classes) == (224, 16, 3, 10)
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.hidden_dim) == (48, 2, 2, 192)
    assert cfg.init_values is not None and cfg.norm_eps == 1e-6 and cfg.pool == "token" and cfg.class_token and cfg.qkv_bias
    encoding = cfg.to_dict()["encoding"]
    assert encoding == dict(
        name="gridpe",
        base=10000.0,
        orientation="random",
        layout="direction_major",
        coords="raw",
        direction_norm="unit",
        indivisible_head_dim="error",
        pairs="interleaved",
    )
    # The directions are the file's, every block's and head's own draw.
    omegas = saved(CHECKPOINT)["model"]
    for i in range(2):
        assert torch.equal(model.pos_enc.omegas[i].float(), omegas[f"blocks.{i}.attn.grid_pe.omegas"])


@pytest.mark.parametrize("ema", [False, True], ids=["model", "model_ema"])
def test_pytorch_equals_the_official_forward_at_every_evaluated_size(ema):
    model = imported(ema=ema).model
    for resolution in RESOLUTIONS:
        with torch.no_grad():
            out = model(probe_images(resolution))
        expected = official("model_ema" if ema else "model", resolution)
        assert out.shape == expected.shape and expected.abs().max() > 0.5  # a real signal
        assert (out - expected).abs().max() <= 1e-5, f"{resolution}: max |Δ| {(out - expected).abs().max():.3g}"


def test_ema_takes_the_other_weights():
    assert imported(ema=True).read["weights"] == "model_ema"
    assert (official("model", (224, 224)) - official("model_ema", (224, 224))).abs().max() > 0.5  # so the test above tells them apart


@pytest.mark.parametrize(
    "option",
    ["layout=scale_major", "pairs=halves", "coords=normalized", "base=100"],
)
def test_each_official_convention_matters(option):
    """Every encoding option the importer sets changes the outputs: the match is not a coincidence."""
    model = imported(options=[option]).model
    with torch.no_grad():
        assert (model(probe_images((320, 320))) - official("model", (320, 320))).abs().max() > 1e-3


def test_the_eval_transform_is_deits():
    recorded = REFERENCE["eval_transform"]  # datasets.build_transform(False, args) for the file's args
    cfg = imported().model.cfg
    assert (recorded["mean"], recorded["std"]) == (list(cfg.mean), list(cfg.std)) == (list(IMAGENET_MEAN), list(IMAGENET_STD))
    assert recorded["interpolation"] == cfg.interpolation == "bicubic" and cfg.crop_mode == "center"
    assert recorded["crop"] == [cfg.img_size] * 2 and recorded["resize"] == int(cfg.img_size / cfg.crop_pct)


@pytest.mark.parametrize(
    "input_size, eval_crop_ratio, img_size, crop_pct",
    [(224, 0.875, 224, 0.875), (384, 1.0, 384, 1.0), (32, 0.875, 32, 1.0)],  # up to 32 px DeiT neither resizes nor crops
)
def test_input_size_and_crop_come_from_the_args(tmp_path, input_size, eval_crop_ratio, img_size, crop_pct):
    def change(contents):
        contents["args"].input_size, contents["args"].eval_crop_ratio = input_size, eval_crop_ratio

    cfg = imported(rewritten(tmp_path, change)).model.cfg
    assert (cfg.img_size, cfg.crop_pct) == (img_size, crop_pct)


def test_a_bare_state_dict_takes_main_py_defaults_and_says_so(tmp_path, model):
    result = imported(rewritten(tmp_path, lambda contents: contents["model"]))
    assert result.assumed == {"input_size": 224, "eval_crop_ratio": 0.875}
    assert result.describe().endswith("not in the file, assumed: input_size=224, eval_crop_ratio=0.875")
    assert "model" not in result.read and "epoch" not in result.read and result.read["weights"] == "the state dict"
    with torch.no_grad():
        torch.testing.assert_close(result.model(probe_images(NON_SQUARE)), official("model", NON_SQUARE), atol=1e-5, rtol=0)


def test_ddp_prefixes_are_dropped(tmp_path):
    def change(contents):
        contents["model"] = {f"module.{k}": v for k, v in contents["model"].items()}

    assert imported(rewritten(tmp_path, change)).read["depth"] == 2


def test_a_file_without_an_ema_copy_is_refused_with_ema(tmp_path):
    path = rewritten(tmp_path, lambda contents: contents.pop("model_ema") and None)
    with pytest.raises(CheckpointError, match="holds no EMA weights .*; drop --ema"):
        imported(path, ema=True)


def _without_omegas(state):
    return {k: v for k, v in state.items() if not k.endswith("grid_pe.omegas")}


def _plain_deit(contents):  # models_v2.deit_small_patch16_LS: a learned pos_embed, no GridPE
    state = _without_omegas(contents["model"])
    contents["model"] = {"cls_token": state.pop("cls_token"), "pos_embed": torch.zeros(1, 196, 48), **state}


def _rope_vit(contents):  # models_rope.rope_mixed_deit_small_patch16_LS: frequencies instead of directions
    contents["model"] = {**_without_omegas(contents["model"]), "freqs": torch.zeros(2, 2, 12)}


def _pct(contents):  # PCT/model_pct_grid.py: a point-cloud transformer with 3-D GridPE
    return {"model": {"conv1.weight": torch.zeros(64, 3, 1), "pt_last.sa1.grid_pe.omegas": torch.zeros(1, 4, 3)}}


def _omegas_3d(contents):
    for i in range(2):
        contents["model"][f"blocks.{i}.attn.grid_pe.omegas"] = torch.zeros(2, 4, 3)


def _use_ape(contents):  # gridpe_vit_models(use_ape=True), which no registered model builds
    contents["model"]["pos_embed"] = torch.zeros(1, 196, 48)


def _block_missing(contents):
    contents["model"] = {k: v for k, v in contents["model"].items() if not k.startswith("blocks.0.")}


def _other_heads(contents):
    contents["args"].num_heads = 4


def _other_model(contents):
    contents["args"].model = "rope_mixed_deit_small_patch16_LS"


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            _plain_deit,
            "is not a GridPE DeiT checkpoint (BoyangL1/Gridpe's VIT/deit/main.py): blocks.0.attn.grid_pe.omegas is missing, "
            "expected block 0's GridPE directions [heads, 3, 2]",
        ),
        (_rope_vit, "blocks.0.attn.grid_pe.omegas is missing, expected block 0's GridPE directions"),
        (_pct, "cls_token is missing, expected the class token [1, 1, width]; its weights begin conv1.weight, pt_last.sa1.grid_pe.omegas"),
        (_omegas_3d, "blocks.0.attn.grid_pe.omegas [2, 4, 3] expected [heads, 3, 2]: GridPE of 2-D image positions"),
        (_use_ape, "pos_embed is there, expected none: the gridpe_* models have no absolute position embedding"),
        (_block_missing, "blocks.0.attn.qkv.weight is missing, expected block 0's fused qkv projection"),
        (_other_heads, "args.num_heads is 4 but blocks.0.attn.grid_pe.omegas holds 2; the weights are not the model the args describe"),
        (_other_model, "args.model is 'rope_mixed_deit_small_patch16_LS', not a gridpe_* model"),
    ],
    ids=["plain-deit", "rope-vit", "pct", "3d-omegas", "use-ape", "block-0-missing", "args-heads", "args-model"],
)
def test_what_is_not_a_gridpe_deit_checkpoint_is_refused_in_one_line(tmp_path, change, expected):
    path = rewritten(tmp_path, change)
    with pytest.raises(CheckpointError) as refused:
        imported(path)
    assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert str(path) in str(refused.value)


def test_a_crop_ratio_deploykit_cannot_crop_is_refused(tmp_path):
    path = rewritten(tmp_path, lambda contents: setattr(contents["args"], "eval_crop_ratio", 1.2))
    with pytest.raises(ConfigError, match=r"args.eval_crop_ratio 1.2: deploykit's preprocessing takes crop ratios in \(0, 1\]"):
        imported(path)


def test_refusals_from_the_command_line(tmp_path, deploykit_cli):
    path = rewritten(tmp_path, _plain_deit)
    code, err = deploykit_cli("import", "gridpe", path, "-o", tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and "blocks.0.attn.grid_pe.omegas is missing" in err, err
    code, err = deploykit_cli("import", "gridpe", path, "--depth", "3", "-o", tmp_path / "out")
    assert code == 2 and "--depth" in err  # nothing to assume: every size is read
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_onnx_runtime_equals_the_official_forward(tmp_path, model):
    out = tmp_path / "export"
    export(model, RESOLUTIONS, out)
    for resolution in RESOLUTIONS:
        name = tag(resolution) if resolution[0] != resolution[1] else resolution[0]
        path = out / f"model_{name}.onnx"
        with OnnxrtRunner(path) as runner:
            actual = runner.infer({"images": probe_images(resolution).numpy()})["logits"]
        np.testing.assert_allclose(actual, official("model", resolution).numpy(), atol=1e-4, rtol=0, err_msg=str(resolution))
        graph = onnx.load(str(path))
        assert lint_graph(graph) == []
        assert not {n.op_type for n in graph.graph.node} & {"If", "Loop", "Scan", "ScatterND", "ScatterElements"}


@pytest.mark.slow
def test_import_export_validate_from_the_command_line(tmp_path, deploykit_cli):
    model_dir, out = tmp_path / "imported", tmp_path / "export"
    code, err = deploykit_cli("import", "gridpe", CHECKPOINT, "--ema", "-o", model_dir)
    assert code == 0, err
    config = json.loads((model_dir / "config.json").read_text())
    assert config["encoding"]["base"] == 10000.0 and config["crop_pct"] == 1.0 and config["depth"] == 2
    with torch.no_grad():
        torch.testing.assert_close(load_model(model_dir)(probe_images(NON_SQUARE)), official("model_ema", NON_SQUARE), atol=1e-5, rtol=0)
    resolutions = ["-r", "224", "-r", "x".join(map(str, NON_SQUARE))]
    # int8 calibrated and checked on few inputs: the defaults (128 and 1000) take minutes on two cores.
    int8 = ["--precision", "int8", "--calibration-samples", "8", "--held-out", "16"]
    code, err = deploykit_cli("export", "-c", model_dir, *resolutions, *int8, "-o", out)
    assert code == 0, err
    for precision in ("fp32", "int8"):
        code, err = deploykit_cli("validate", out, "--precision", precision, "--num-random", "2", "--num-real", "2")
        assert code == 0 and "2/2 checks passed" in err, err

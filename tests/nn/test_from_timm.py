"""``deploykit import timm``: ViT, DeiT-III, RoPE-ViT, DINOv3 and EVA-02 give timm's outputs, in
PyTorch (≤ 1e-5, float32) and exported to ONNX Runtime (≤ 1e-4), at the native resolution, a
non-square one and a larger one (EVA-02: and a smaller one); graphs pass the lint and
TensorRT-RTX builds them.

The first part runs everywhere against timm's recorded outputs (``timm_reference.py``: timm
does not import beside CI's CPU torch); the second part runs timm itself, where it imports:
checkpoint files as timm reads them (DINOv3 in Meta's layout, training containers).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
import pytest
import torch
from timm_reference import (
    CASES,
    META_CASES,
    RESOLUTIONS,
    meta_dinov3_state,
    meta_reference,
    probe_images,
    read_fixture,
    resolutions,
    seeded_state_dict,
    tag,
    timm_reference,
)

from deploykit._lazy import is_available
from deploykit.cli import main
from deploykit.export import export, lint_graph
from deploykit.inputs.imaging import Preprocessing
from deploykit.nn import VisionTransformer, ViTConfig, load_model
from deploykit.nn.checkpoint import load_weights
from deploykit.nn.from_timm import preprocessing_fields, state_dict_from_timm
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.validation.run import validate

# torch.onnx's dynamo exporter trips a deprecation inside torch.utils._pytree; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
REFERENCE = read_fixture()
META = REFERENCE["dinov3_meta_format"]
ROTATING = [n for n in CASES if REFERENCE[n]["config"]["encoding"]["name"].startswith("rope")]


def converted(name: str, **encoding_changes) -> VisionTransformer:
    """deploykit's model from the recorded config and timm-named seeded weights (no timm needed)."""
    data = json.loads(json.dumps(REFERENCE[name]["config"]))
    data["encoding"].update(encoding_changes)
    model = VisionTransformer(ViTConfig.from_dict(data))
    load_weights(model, state_dict_from_timm(seeded_state_dict(REFERENCE[name]["shapes"])), name)
    return model.eval()


def timm_output(name: str, resolution) -> torch.Tensor:
    return torch.tensor(REFERENCE[name]["outputs"][tag(resolution)])


def exported_resolutions(name: str):
    return resolutions(name)[:2]  # native and non-square


@pytest.mark.parametrize("name", CASES)
def test_pytorch_model_equals_timm_at_every_resolution(name):
    model = converted(name)
    for resolution in resolutions(name):
        with torch.no_grad():
            out = model(probe_images(resolution))
        expected = timm_output(name, resolution)
        assert out.shape == expected.shape
        assert expected.abs().max() > 0.1  # a real signal
        # fp32 rounding grows with the outputs' size, and differs between CPUs' kernels (AVX2, AVX-512)
        scale = max(1.0, float(expected.abs().max()))
        torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=0)


def test_plain_bicubic_resize_would_not_match_timm():
    # The bug fixed here: deploykit resized pos_embed without antialias; timm's default has it.
    model = converted("vit_tiny_patch16_224", antialias=False)
    with torch.no_grad():
        assert (model(probe_images((96, 96))) - timm_output("vit_tiny_patch16_224", (96, 96))).abs().max() > 1e-3


def test_eva02_positions_are_on_the_reference_grid_at_every_resolution():
    # EVA-02's RoPE measures a 4x4 grid in units of its 16x16 pre-training grid, even at the native size.
    name = "eva02_tiny_patch14_224"
    model = converted(name, ref_grid=None)
    for resolution in resolutions(name):
        with torch.no_grad():
            assert (model(probe_images(resolution)) - timm_output(name, resolution)).abs().max() > 1e-3


@pytest.mark.parametrize("name", CASES)
def test_preprocessing_is_timms_data_config(name):
    """What ``import timm`` records is what timm's ``resolve_data_config`` makes of the model's
    ``pretrained_cfg`` (both recorded from timm), and the config holds it."""
    recorded = REFERENCE[name]
    fields = preprocessing_fields(recorded["pretrained_cfg"])
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()} == recorded["data_config"]
    assert {k: recorded["config"][k] for k in fields} == recorded["data_config"]
    assert converted(name).cfg.preprocessing == Preprocessing(**fields)


def test_preprocessing_fields_take_timms_defaults_and_its_crop_modes():
    # timm's vision_transformer.py: a CLIP fine-tune's cfg (crop_mode='squash'), and an entry left empty.
    squash = dict(
        crop_pct=1.0,
        crop_mode="squash",
        interpolation="bicubic",
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
    )
    assert preprocessing_fields(squash)["crop_mode"] == "squash"
    assert preprocessing_fields(dict(crop_pct=None, interpolation="")) == dict(
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875, crop_mode="center", interpolation="bicubic"
    )


def test_conventions_are_recorded_in_the_config():
    dino = REFERENCE["vit_small_patch16_dinov3_qkvb"]["config"]
    assert dino["encoding"]["coords"] == "centered" and dino["encoding"]["angle_scale"] == pytest.approx(2 * 3.141592653589793)
    assert (dino["encoding"]["axis_order"], dino["encoding"]["pairs"], dino["reg_tokens"]) == ("yx", "halves", 4)
    assert dino["num_classes"] == 0 and dino["global_pool"] == "avg" and dino["init_values"] is not None
    assert REFERENCE["vit_small_plus_patch16_dinov3"]["config"]["mlp_layer"] == "swiglu"
    rope = REFERENCE["vit_small_patch16_rope_mixed_ape_224"]["config"]["encoding"]
    assert (rope["name"], rope["axis_order"], rope["ape"], rope["no_embed_class"]) == ("rope-mixed", "xy", True, True)
    assert REFERENCE["deit3_small_patch16_224"]["config"]["encoding"]["no_embed_class"] is True
    assert REFERENCE["vit_medium_patch16_reg4_gap_256"]["config"]["fc_norm"] is True
    eva = {n: REFERENCE[n]["config"] for n in CASES if n.startswith("eva02")}
    rope = eva["eva02_tiny_patch14_224"]["encoding"]
    assert (rope["name"], rope["ref_grid"], rope["axis_order"], rope["pairs"], rope["theta"]) == (
        "rope-axial",
        [16, 16],
        "yx",
        "interleaved",
        1e4,
    )
    assert rope["ape"] is True and rope["no_embed_class"] is False
    fields = ("mlp_layer", "mlp_norm", "attn_norm", "qkv_bias")
    assert [tuple(c[f] for f in fields) for c in eva.values()] == [
        ("swiglu_packed", False, False, True),
        ("swiglu", True, False, True),
        ("swiglu", True, True, True),
    ]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> export directory (native and non-square resolution, fp32), each exported once."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = tmp_path_factory.mktemp(name)
            export(converted(name), list(exported_resolutions(name)), done[name])
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_onnx_runtime_equals_timm(exported, name):
    out = exported(name)
    for resolution in exported_resolutions(name):
        path = out / f"model_{tag(resolution) if resolution[0] != resolution[1] else resolution[0]}.onnx"
        with OnnxrtRunner(path) as runner:
            actual = runner.infer({"images": probe_images(resolution).numpy()})["logits"]
        np.testing.assert_allclose(actual, timm_output(name, resolution).numpy(), atol=1e-4, rtol=0)
        assert lint_graph(onnx.load(str(path))) == []


# Each case costs an export of a ViT-S: the quick set checks the first, the whole suite all.
@pytest.mark.parametrize("name", [ROTATING[0], *(pytest.param(n, marks=pytest.mark.slow) for n in ROTATING[1:])])
def test_rotation_tables_are_fp32_initializers_without_control_flow(exported, name):
    proto = onnx.load(str(exported(name) / f"model_{tag(exported_resolutions(name)[1])}.onnx"))
    tables = [t for t in proto.graph.initializer if t.name.startswith("pe_tables.")]
    assert tables and all(t.data_type == onnx.TensorProto.FLOAT for t in tables)
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"If", "Loop", "Scan", "ScatterND", "ScatterElements"}, ops


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_tensorrt_rtx_builds_every_graph(exported, name):
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install 'deploykit[rtx]')")
    from deploykit.backends.build import build

    results = build(exported(name), "rtx", optimization_level=0)
    assert len(results) == len(exported_resolutions(name)) and all(r.engine.stat().st_size > 1000 for r in results)


def test_validate_compares_backbone_features(exported, capsys):
    out = exported("vit_small_patch16_dinov3_qkvb")
    report = validate(out, num_random=2, num_real=2)
    assert report and all(r.top1_agreement is None and r.cosine > 0.99999 for r in report.records)
    main(["validate", str(out), "--num-random", "1", "--num-real", "1"])
    assert "(features)" in capsys.readouterr().err


def test_hub_retries_without_network_are_not_shown(tmp_path, deploykit_cli, monkeypatch):
    """Without network the hub client logs every failed request and each retry as a warning, on
    a stderr handler of its own (two dozen lines over a minute, even with -q); the import then
    shows only its one error line. timm is faked: what is checked is the hub's logging."""
    import logging
    import sys
    import types

    from deploykit.nn import from_timm

    def create_model(name, pretrained=False, **kwargs):  # timm.create_model as it fails offline
        http = logging.getLogger("huggingface_hub.utils._http")
        for attempt in range(1, 6):
            http.warning("'[Errno -2] Name or service not known' thrown while requesting HEAD https://huggingface.co/timm/x")
            http.warning(f"Retrying in 1s [Retry {attempt}/5].")
        raise OSError("An error happened while trying to locate the file on the Hub.\nPlease check your connection.")

    hub = logging.getLogger("huggingface_hub")
    level = hub.level  # WARNING where the real hub client is imported, NOTSET elsewhere
    handler = logging.StreamHandler(sys.stderr)  # the hub's own handler (huggingface_hub.utils.logging)
    hub.addHandler(handler)
    monkeypatch.setattr(from_timm, "lazy_import", lambda module: types.SimpleNamespace(create_model=create_model))
    monkeypatch.setattr(from_timm, "timm_model", lambda name, **kwargs: torch.nn.Linear(1, 1))
    monkeypatch.setattr(from_timm, "config_from_timm", lambda model, name: None)
    try:
        code, err = deploykit_cli("import", "timm", "vit_tiny_patch16_224", "-o", tmp_path / "out")
    finally:
        hub.removeHandler(handler)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: cannot fetch timm's pretrained weights for vit_tiny_patch16_224 (OSError: An error happened")
    assert hub.level == level and not (tmp_path / "out").exists()


def test_ema_needs_a_file(tmp_path, deploykit_cli):
    code, err = deploykit_cli("import", "timm", "vit_tiny_patch16_224", "--ema", "-o", tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and "--ema takes the EMA copy of a checkpoint file" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- with timm itself

timm_required = pytest.mark.skipif(
    not is_available("timm"),
    reason="timm does not import here (PyPI's torchvision for this torch is a CUDA build); recorded outputs above stand in",
)


def seeded_timm(name: str):
    """timm's model with the seeded weights, and a ``.pth`` of them."""
    import timm

    model = timm.create_model(name, pretrained=False, **CASES[name]).eval()
    model.load_state_dict(seeded_state_dict({k: list(v.shape) for k, v in model.state_dict().items()}))
    return model


def kwargs_args(name: str, kwargs: dict | None = None) -> list[str]:
    return [a for k, v in (kwargs or CASES[name]).items() for a in ("--model-kwargs", f"{k}={v!r}")]


@timm_required
@pytest.mark.parametrize("name", CASES)
def test_recorded_outputs_are_timms(name):
    fresh, recorded = timm_reference(name), REFERENCE[name]
    assert fresh["config"] == recorded["config"] and fresh["shapes"] == recorded["shapes"]
    assert fresh["pretrained_cfg"] == recorded["pretrained_cfg"] and fresh["data_config"] == recorded["data_config"]
    for key, value in fresh["outputs"].items():
        torch.testing.assert_close(torch.tensor(value), torch.tensor(recorded["outputs"][key]), atol=1e-5, rtol=0)


@timm_required
@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "deit3_small_patch16_224", "vit_small_patch16_dinov3_qkvb"])
def test_import_export_validate_from_the_command_line(tmp_path, deploykit_cli, name):
    timm_model = seeded_timm(name)
    weights = tmp_path / "seeded.pth"
    torch.save(timm_model.state_dict(), weights)
    model_dir, out = tmp_path / "imported", tmp_path / "export"
    assert deploykit_cli("import", "timm", name, "-w", weights, *kwargs_args(name), "-o", model_dir)[0] == 0
    native, wide = exported_resolutions(name)
    with torch.no_grad():
        torch.testing.assert_close(load_model(model_dir)(probe_images(wide)), timm_model(probe_images(wide)), atol=1e-5, rtol=0)
    assert deploykit_cli("export", "-c", model_dir, "-r", native[0], "-r", tag(wide), "-o", out)[0] == 0
    code, err = deploykit_cli("validate", out, "--num-random", "2", "--num-real", "2")
    assert code == 0 and "2/2 checks passed" in err


@timm_required
def test_set_changes_the_imported_encoding(tmp_path, deploykit_cli):
    name = "vit_tiny_patch16_224"
    weights = tmp_path / "seeded.pth"
    torch.save(seeded_timm(name).state_dict(), weights)
    args = ["import", "timm", name, "-w", weights, *kwargs_args(name), "-o", tmp_path / "m"]
    assert deploykit_cli(*args, "--set", "antialias=false")[0] == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["encoding"]["antialias"] is False
    code, err = deploykit_cli(*args[:-2], "--set", "antialiasing=false", "-o", tmp_path / "n")
    assert code == 1 and "valid options: antialias, interpolation, no_embed_class" in err and not (tmp_path / "n").exists()


@timm_required
@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("vit_tiny_patch16_244", [], "timm has no model 'vit_tiny_patch16_244'; did you mean vit_tiny_patch16_224"),
        ("resnet18", [], "class ResNet is not supported"),
        ("vit_base_patch16_clip_224", ["depth=1"], "not supported: a patch embedding without bias; a norm before the blocks (pre_norm)"),
        ("eva02_enormous_patch14_clip_224", ["depth=1"], "not supported: EvaBlockPostNorm blocks"),
        ("vit_small_patch16_18x2_224", ["depth=1"], "not supported: ParallelThingsBlock blocks; attention variants"),
    ],
)
def test_unknown_or_unsupported_models_are_one_line_errors(tmp_path, deploykit_cli, name, kwargs, expected):
    args = [a for kw in kwargs for a in ("--model-kwargs", kw)]
    code, err = deploykit_cli("import", "timm", name, "-w", tmp_path / "unused.pth", *args, "-o", tmp_path / "out")
    assert code == 1 and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@timm_required
def test_weights_of_another_model_name_the_keys(tmp_path, deploykit_cli):
    weights = tmp_path / "rope.pth"
    torch.save(seeded_timm("vit_small_patch16_rope_224").state_dict(), weights)
    name = "vit_small_patch16_dinov3_qkvb"
    code, err = deploykit_cli("import", "timm", name, "-w", weights, *kwargs_args(name), "-o", tmp_path / "out")
    assert code == 1 and err.count("\n") == 1, err
    assert "missing " in err and "blocks.0.attn.q_bias" in err and "more)" in err and "unexpected " in err
    assert not (tmp_path / "out").exists()


@timm_required
def test_pretrained_weights_without_hub_access_are_one_line(tmp_path, deploykit_cli, monkeypatch):
    import huggingface_hub.constants

    # No network here, and none attempted: the hub client's offline mode fails at once.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = deploykit_cli("import", "timm", "vit_tiny_patch16_224", "-o", tmp_path / "out")
    assert code == 1 and "cannot fetch timm's pretrained weights for vit_tiny_patch16_224" in err and "--weights" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


@timm_required
@pytest.mark.parametrize("name", META_CASES)
def test_recorded_meta_format_outputs_are_timms(name):
    fresh, recorded = meta_reference(name), META[name]
    assert fresh["shapes"] == recorded["shapes"]
    for key, value in fresh["outputs"].items():
        torch.testing.assert_close(torch.tensor(value), torch.tensor(recorded["outputs"][key]), atol=1e-5, rtol=0)


def meta_state(name: str) -> dict[str, torch.Tensor]:
    """The seeded weights of ``META_CASES[name]`` in Meta's DINOv3 layout."""
    kwargs = META_CASES[name]
    return meta_dinov3_state(seeded_state_dict(META[name]["shapes"]), kwargs["embed_dim"] // kwargs["num_heads"])


def meta_file(path, name: str):
    """``meta_state`` saved as a fine-tuning script's container (weights under ``model``, its args beside)."""
    torch.save({"model": meta_state(name), "epoch": 9, "args": argparse.Namespace(lr=1e-4)}, path)
    return path


@timm_required
@pytest.mark.parametrize("name", META_CASES)
def test_dinov3_file_in_metas_layout_imports_as_timm_loads_it(tmp_path, deploykit_cli, name):
    weights = meta_file(tmp_path / "dinov3_finetune.pth", name)
    code, err = deploykit_cli("import", "timm", name, "-w", weights, *kwargs_args(name, META_CASES[name]), "-o", tmp_path / "m")
    assert code == 0, err
    model = load_model(tmp_path / "m")
    for resolution in RESOLUTIONS:
        with torch.no_grad():
            out = model(probe_images(resolution))
        torch.testing.assert_close(out, torch.tensor(META[name]["outputs"][tag(resolution)]), atol=1e-5, rtol=0)


@timm_required
def test_biases_timm_would_drop_are_refused_in_one_line(tmp_path, deploykit_cli):
    # timm's DINOv3 filter drops qkv.bias for a model without q/v biases; these are not zero.
    name = "vit_small_plus_patch16_dinov3_qkvb"
    weights, args = meta_file(tmp_path / "dinov3.pth", name), kwargs_args(name, META_CASES[name])
    code, err = deploykit_cli("import", "timm", "vit_small_plus_patch16_dinov3", "-w", weights, *args, "-o", tmp_path / "m")
    assert code == 1 and err.count("\n") == 1, err
    assert "non-zero q/v biases (blocks.0.attn.qkv.bias (+1 more))" in err and "qkv_bias=True" in err
    assert not (tmp_path / "m").exists()
    args += ["--model-kwargs", "qkv_bias=True"]  # the hint: the same model with q/v biases takes them
    assert deploykit_cli("import", "timm", "vit_small_plus_patch16_dinov3", "-w", weights, *args, "-o", tmp_path / "m")[0] == 0


@timm_required
def test_ema_takes_the_files_ema_copy(tmp_path, deploykit_cli):
    name = "vit_base_patch16_dinov3"
    ema = meta_state(name)
    torch.save({"model": dict(ema, **{"norm.weight": 2 * ema["norm.weight"]}), "model_ema": ema}, tmp_path / "ckpt.pth")
    args = ["import", "timm", name, "-w", tmp_path / "ckpt.pth", *kwargs_args(name, META_CASES[name])]
    assert deploykit_cli(*args, "--ema", "-o", tmp_path / "ema")[0] == 0 and deploykit_cli(*args, "-o", tmp_path / "model")[0] == 0
    x, expected = probe_images(RESOLUTIONS[0]), torch.tensor(META[name]["outputs"][tag(RESOLUTIONS[0])])
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "ema")(x), expected, atol=1e-5, rtol=0)
        assert (load_model(tmp_path / "model")(x) - expected).abs().max() > 1e-3

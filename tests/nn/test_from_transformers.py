"""``deploykit import hf``: Hugging Face ``transformers`` ViT, DeiT and DINOv2 directories give
``transformers``' own outputs.

Every case is a seeded tiny model built with ``transformers`` itself (hidden 32, 2 layers), saved
with ``save_pretrained`` and compared with its own forward: PyTorch at the native and a
non-square and a larger size (``interpolate_pos_encoding``, which DINOv2 always does), ONNX
Runtime at all three.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

# transformers imports torchvision where it is installed; PyPI's torchvision is built against CUDA
# torch and does not import beside the CPU torch the suite pins (tests/nn/timm_reference.py). The
# models used here need no torchvision, so a broken one is hidden (image processors fall back to PIL).
# Process-wide: where torchvision is broken, a later `import torchvision` (timm's) raises ImportError
# instead of RuntimeError; both are deploykit's one-line MissingDependencyError.
try:
    import torchvision  # noqa: F401
except Exception:  # RuntimeError: operator torchvision::nms does not exist
    for _name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[_name]
    sys.modules["torchvision"] = None  # importlib.util.find_spec answers None: transformers sees no torchvision

import transformers  # the test extra installs it: a broken install fails here by name

from deploykit.export import export
from deploykit.nn import load_model
from deploykit.nn.from_transformers import import_transformers, is_transformers_directory
from deploykit.runners.onnxrt import OnnxrtRunner

NATIVE, WIDE, LARGE = (32, 32), (48, 32), (64, 64)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
_DINO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
# SigLIP2's tower has no image_size: its position table is a grid of num_patches (4x4 at patch 8: 32 px)
_SIGLIP2 = dict({k: v for k, v in _VIT.items() if k != "image_size"}, num_patches=16)
# case -> (model class, config class, config kwargs)
CASES = {
    "vit_classifier": ("ViTForImageClassification", "ViTConfig", dict(_VIT, num_labels=5)),
    "vit_model": ("ViTModel", "ViTConfig", dict(_VIT, layer_norm_eps=1e-6, qkv_bias=False)),
    "deit_classifier": ("DeiTForImageClassification", "DeiTConfig", dict(_VIT, num_labels=5)),
    "deit_model": ("DeiTModel", "DeiTConfig", dict(_VIT)),
    "deit_distilled": ("DeiTForImageClassificationWithTeacher", "DeiTConfig", dict(_VIT, num_labels=5)),
    # SigLIP: no class token, tanh GELU, attention pooling (pooler_output); without its head every token
    "siglip": ("SiglipVisionModel", "SiglipVisionConfig", dict(_VIT)),
    "siglip_tokens": ("SiglipVisionModel", "SiglipVisionConfig", dict(_VIT, vision_use_head=False, hidden_act="gelu")),
    "siglip_classifier": ("SiglipForImageClassification", "SiglipConfig", dict(vision_config=_VIT, text_config=_TEXT, num_labels=5)),
    "siglip2": ("Siglip2VisionModel", "Siglip2VisionConfig", _SIGLIP2),
    "dinov2": ("Dinov2Model", "Dinov2Config", dict(_DINO, layerscale_value=0.5)),
    "dinov2_swiglu": ("Dinov2Model", "Dinov2Config", dict(_DINO, use_swiglu_ffn=True)),
    "dinov2_registers": ("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", dict(_DINO, num_register_tokens=3)),
    # DINOv3: RoPE at patch centres, registers, LayerScale; k without bias (its default), or SwiGLU and no q/v bias
    "dinov3": ("DINOv3ViTModel", "DINOv3ViTConfig", dict(_VIT, num_register_tokens=2)),
    "dinov3_gated": (
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        dict(_VIT, num_register_tokens=4, use_gated_mlp=True, hidden_act="silu", query_bias=False, value_bias=False),
    ),
}


def seeded(case: str, seed: int = 0):
    """The case's ``transformers`` model with seeded weights large enough that every term counts
    (transformers initialises LayerScale and biases to constants)."""
    model_class, config_class, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return model


def reference(model, images: torch.Tensor) -> torch.Tensor:
    """What deploykit's model answers for: the logits, or the normed class token of a bare trunk
    (``pooler_output`` for DINOv2; ``last_hidden_state[:, 0]`` for ViT/DeiT, whose pooler is not it),
    or SigLIP's ``pooler_output`` (every token without its head)."""
    model_type = model.config.model_type
    with torch.no_grad():
        if model_type == "siglip2_vision_model":
            out = model(**siglip2_inputs(images, model.config.patch_size))
        else:
            out = model(pixel_values=images, **({} if model_type.startswith("dinov2") else dict(interpolate_pos_encoding=True)))
    if hasattr(out, "logits"):
        return out.logits
    if model_type.startswith("siglip"):
        return out.last_hidden_state if out.pooler_output is None else out.pooler_output
    return out.last_hidden_state[:, 0]


def siglip2_inputs(images: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """Images as SigLIP2 takes them: patches flattened (row, column, channel) as
    ``Siglip2ImageProcessor``'s ``convert_image_to_patches``, all valid, one grid per image."""
    b, c, h, w = images.shape
    patches = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, patch * patch * c)
    return dict(
        pixel_values=patches,
        pixel_attention_mask=torch.ones(patches.shape[:2], dtype=torch.long),
        spatial_shapes=torch.tensor([[h // patch, w // patch]] * b),
    )


def images(resolution, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, *resolution, generator=torch.Generator().manual_seed(seed))


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (transformers model, its save_pretrained directory), each saved once."""
    done = {}

    def get(case):
        if case not in done:
            model, directory = seeded(case), tmp_path_factory.mktemp(case)
            model.save_pretrained(directory)
            done[case] = model, directory
        return done[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_pytorch_model_equals_transformers(saved, case):
    source, directory = saved(case)
    model = import_transformers(directory).model
    for resolution in (NATIVE, WIDE, LARGE):
        x = images(resolution)
        expected = reference(source, x)
        with torch.no_grad():
            actual = model(x)
        assert actual.shape == expected.shape
        assert relative_error(actual, expected) <= 1e-5, (case, resolution)
        if model.cfg.num_classes:
            assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_conventions_are_read_from_the_config(saved):
    cfgs = {case: import_transformers(saved(case)[1]).model.cfg for case in CASES}
    assert [cfgs[c].num_classes for c in ("vit_classifier", "vit_model", "deit_classifier", "deit_model")] == [5, 0, 5, 0]
    assert (cfgs["deit_distilled"].distilled, cfgs["deit_classifier"].distilled) == (True, False)
    siglip = [cfgs[c] for c in ("siglip", "siglip_tokens", "siglip_classifier", "siglip2")]
    assert [c.pool for c in siglip] == ["map", "", "avg", "map"] and not any(c.class_token for c in siglip)
    assert [c.act_layer for c in siglip] == ["gelu_tanh", "gelu", "gelu_tanh", "gelu_tanh"]  # transformers' gelu_pytorch_tanh default
    assert cfgs["siglip_classifier"].num_classes == 5 and cfgs["siglip2"].img_size == 32  # sqrt(num_patches) * patch
    # transformers resizes SigLIP's table bicubic, SigLIP2's bilinear with antialiasing
    assert [(c.encoding.interpolation, c.encoding.antialias) for c in siglip[::3]] == [("bicubic", False), ("bilinear", True)]
    assert (cfgs["vit_classifier"].norm_eps, cfgs["vit_model"].norm_eps) == (1e-12, 1e-6)  # transformers' ViT default, then the file's
    assert (cfgs["vit_classifier"].qkv_bias, cfgs["vit_model"].qkv_bias) == (True, False)
    assert [cfgs[c].reg_tokens for c in ("vit_classifier", "deit_classifier", "dinov2", "dinov2_registers")] == [0, 1, 0, 3]
    assert (cfgs["dinov2"].init_values, cfgs["vit_classifier"].init_values) == (0.5, None)
    assert (cfgs["dinov2_swiglu"].mlp_layer, cfgs["dinov2_swiglu"].hidden_dim) == ("swiglu", 88)  # (int(128 * 2/3) + 7) // 8 * 8
    assert (cfgs["dinov3"].qkv_bias, cfgs["dinov3_gated"].qkv_bias, cfgs["dinov3_gated"].mlp_layer) == (True, False, "swiglu")
    rope = cfgs["dinov3"].encoding
    assert (rope.coords, rope.axis_order, rope.pairs, rope.theta) == ("centered", "yx", "halves", 100.0)
    # transformers resizes DINOv2-with-registers' table with antialiasing, the others without
    assert [cfgs[c].encoding.antialias for c in ("vit_classifier", "deit_classifier", "dinov2", "dinov2_registers")] == [
        False,
        False,
        False,
        True,
    ]


def test_what_is_left_out_is_said(saved):
    """ViTModel's pooler (dense + tanh) is not the output and DINOv2's mask token is used only with
    bool_masked_pos: both are named in what the import reports, not dropped without a word."""
    assert "left out pooler.dense.bias, pooler.dense.weight" in import_transformers(saved("vit_model")[1]).read["note"]
    assert "left out embeddings.mask_token" in import_transformers(saved("dinov2")[1]).read["note"]
    assert "note" not in import_transformers(saved("vit_classifier")[1]).read
    assert "left out head.*" in import_transformers(saved("siglip_classifier")[1]).read["note"]  # its logits read the mean token
    assert "vision_use_head false" in import_transformers(saved("siglip_tokens")[1]).read["note"]


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    done = {}

    def get(case):
        if case not in done:
            done[case] = tmp_path_factory.mktemp(f"{case}_export")
            export(import_transformers(saved(case)[1]).model, [NATIVE, WIDE, LARGE], done[case])
        return done[case]

    return get


# Each case exports three graphs (6-9 s): the quick set checks DINOv3's RoPE (the APE path is also
# checked quickly, through the CLI, by test_export_and_validate_take_a_transformers_directory); -m "" all.
@pytest.mark.parametrize(
    "case",
    [
        "dinov3_gated",
        "siglip",
        *(
            pytest.param(c, marks=pytest.mark.slow)
            for c in (
                "vit_classifier",
                "deit_classifier",
                "deit_distilled",
                "dinov2_swiglu",
                "dinov2_registers",
                "siglip_classifier",
                "siglip2",
            )
        ),
    ],
)
def test_onnx_runtime_equals_transformers(saved, exported, case):
    source, out = saved(case)[0], exported(case)
    for resolution, name in ((NATIVE, "model_32.onnx"), (WIDE, "model_48x32.onnx"), (LARGE, "model_64.onnx")):
        x = images(resolution)
        with OnnxrtRunner(out / name) as runner:
            actual = runner.infer({"images": x.numpy()})["logits"]
        expected = reference(source, x)
        assert relative_error(actual, expected) <= 1e-4, (case, resolution)
        if type(source).__name__.endswith(("ForImageClassification", "WithTeacher")):  # top-1 where there is a head
            assert np.array_equal(actual.argmax(-1), expected.argmax(-1).numpy())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["siglip", "deit_distilled"])
def test_tensorrt_rtx_builds_the_pooling_and_distilled_graphs(exported, case):
    """TensorRT-RTX's real parser and builder take the attention pooling (a one-query attention),
    the tanh GELU and the averaged heads at every exported size."""
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install 'deploykit[rtx]')")
    from deploykit.backends.build import build

    results = build(exported(case), "rtx", optimization_level=0)
    assert len(results) == 3 and all(r.engine.stat().st_size > 1000 for r in results)


def test_import_hf_from_the_command_line_and_directories_are_recognised(saved, tmp_path, deploykit_cli):
    source, directory = saved("dinov2_registers")
    assert is_transformers_directory(directory) and not is_transformers_directory(tmp_path)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "imported")
    assert code == 0 and "Dinov2WithRegistersModel" in err, err
    assert not is_transformers_directory(tmp_path / "imported")  # deploykit's own config.json
    x = images(WIDE)
    for model in (load_model(tmp_path / "imported"), load_model(directory)):  # written, and taken as it is
        with torch.no_grad():
            assert relative_error(model(x), reference(source, x)) <= 1e-5


@pytest.mark.parametrize("case", ["vit_classifier", pytest.param("siglip", marks=pytest.mark.slow)])
def test_export_and_validate_take_a_transformers_directory(saved, tmp_path, deploykit_cli, case):
    source, directory = saved(case)
    code, err = deploykit_cli("export", "-c", directory, "-r", "48x32", "-o", tmp_path / "export")
    assert code == 0, err
    x = images(WIDE)
    with OnnxrtRunner(tmp_path / "export" / "model_48x32.onnx") as runner:
        assert relative_error(runner.infer({"images": x.numpy()})["logits"], reference(source, x)) <= 1e-4
    code, err = deploykit_cli("validate", tmp_path / "export", "--num-random", "2", "--num-real", "2")
    assert code == 0 and "checks passed" in err, err


def _edited(directory, tmp_path, **changes):
    """A copy of a saved directory whose config.json has ``changes`` (None deletes a key)."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    data = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (copy / "config.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            dict(model_type="swin"),
            "transformers model_type 'swin' is not mapped; deploykit maps deit, dinov2, dinov2_with_registers, dinov3_vit, siglip, siglip2_vision_model, siglip_vision_model, vit",
        ),
        (dict(architectures=["ViTForMaskedImageModeling"]), "architecture ViTForMaskedImageModeling is not mapped"),
        (dict(hidden_act="gelu_new"), "option hidden_act='gelu_new' is not mapped"),
        (dict(image_size=[32, 48]), "image_size [32, 48] is not square"),
        (dict(use_rope=True), "option 'use_rope' is not mapped"),
        (dict(pruned_heads={"0": [1]}), "option 'pruned_heads' is not mapped"),
        (dict(layer_norm_eps="tiny"), "(ViTForImageClassification): could not convert string to float: 'tiny'"),
        (dict(intermediate_size=-1), "(ViTForImageClassification): mlp_ratio must be a finite number > 0"),
    ],
)
def test_unmapped_types_and_options_are_refused_in_one_line(saved, tmp_path, deploykit_cli, changes, expected):
    directory = _edited(saved("vit_classifier")[1], tmp_path, **changes)
    for args in (("import", "hf", directory, "-o", tmp_path / "out"), ("export", "-c", directory, "-r", "32", "-o", tmp_path / "out")):
        code, err = deploykit_cli(*args)
        assert code == 1 and expected in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(mlp_bias=False), "option mlp_bias=False is not mapped (projections without bias)"),
        (dict(hidden_act="gelu"), "option hidden_act='gelu' is not mapped (deploykit's gated MLP uses SiLU)"),
        (dict(pos_embed_grid=2), "option 'pos_embed_grid' is not mapped"),
    ],
)
def test_unmapped_dinov3_options_are_refused_in_one_line(saved, tmp_path, deploykit_cli, changes, expected):
    directory = _edited(saved("dinov3_gated")[1], tmp_path, **changes)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def _edited_vision(directory, tmp_path, **changes):
    """A copy of a SigLIP classifier directory whose vision_config has ``changes``."""
    vision = json.loads((directory / "config.json").read_text())["vision_config"]
    return _edited(directory, tmp_path, vision_config={**vision, **changes})


@pytest.mark.parametrize(
    "case, changes, expected",
    [
        ("siglip", dict(hidden_act="quick_gelu"), "option hidden_act='quick_gelu' is not mapped"),
        ("siglip2", dict(num_patches=15), "num_patches 15 is not a square grid of positions"),
        ("siglip2", dict(image_size=32), "option 'image_size' is not mapped"),
        ("siglip_classifier", dict(logit_scale_init=1.0), "SiglipForImageClassification option 'logit_scale_init' is not mapped"),
        ("siglip_classifier", dict(vision_config=[1]), "SiglipForImageClassification config has no vision_config object"),
    ],
)
def test_unmapped_siglip_options_are_refused_in_one_line(saved, tmp_path, deploykit_cli, case, changes, expected):
    directory = _edited(saved(case)[1], tmp_path, **changes)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_siglip_classifier_options_are_read_from_its_vision_config(saved, tmp_path, deploykit_cli):
    directory = _edited_vision(saved("siglip_classifier")[1], tmp_path, hidden_act="relu")
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and "SiglipForImageClassification vision_config option hidden_act='relu' is not mapped" in err, err
    assert not (tmp_path / "out").exists()


def test_siglip2s_per_image_resize_is_refused(saved, tmp_path, deploykit_cli):
    """Siglip2ImageProcessor resizes every image to its own grid (NaFlex): one fixed grid per graph is not that."""
    directory = _edited(saved("siglip2")[1], tmp_path)
    transformers.Siglip2ImageProcessor(patch_size=8, max_num_patches=16).save_pretrained(directory)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and "image_processor_type 'Siglip2ImageProcessor" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "model_class, config_class, expected",
    [
        ("Dinov2ForImageClassification", "Dinov2Config", "its head reads the class token concatenated with the mean patch token"),
    ],
)
def test_heads_the_trunk_does_not_compute_are_refused(tmp_path, deploykit_cli, model_class, config_class, expected):
    kwargs = dict(_VIT, num_labels=3) if config_class == "DeiTConfig" else dict(_DINO, num_labels=3)
    getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).save_pretrained(tmp_path / "hf")
    code, err = deploykit_cli("import", "hf", tmp_path / "hf", "-o", tmp_path / "out")
    assert code == 1 and f"{model_class} is not mapped: {expected}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_weights_that_do_not_fit_are_refused_by_name(saved, tmp_path, deploykit_cli):
    from safetensors.torch import load_file, save_file

    directory = _edited(saved("dinov2")[1], tmp_path)
    state = load_file(directory / "model.safetensors")
    state["encoder.layer.0.attention.attention.gate.weight"] = torch.zeros(32, 32)
    save_file(state, directory / "model.safetensors")
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and "unexpected encoder.layer.0.attention.attention.gate.weight" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize(
    "processor, kwargs, expected",
    [
        # ViT: resize to size, no crop
        ("ViTImageProcessor", dict(size={"height": 32, "width": 32}), dict(crop_mode="squash", crop_pct=1.0, interpolation="bilinear")),
        # DeiT: resize to size, centre-crop crop_size
        (
            "DeiTImageProcessor",
            dict(size={"height": 40, "width": 40}, crop_size={"height": 32, "width": 32}, resample=3),
            dict(crop_mode="squash", crop_pct=0.8, interpolation="bicubic"),
        ),
        # DINOv2: short side, then centre crop
        (
            "BitImageProcessor",
            dict(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.4]),
            dict(crop_mode="center", crop_pct=0.8, interpolation="bicubic", mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4)),
        ),
        # SigLIP: resize to size, no crop, its own mean/std of 0.5 and bicubic by default
        (
            "SiglipImageProcessor",
            dict(size={"height": 32, "width": 32}),
            dict(crop_mode="squash", crop_pct=1.0, interpolation="bicubic", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
        ),
    ],
)
def test_preprocessing_is_read_as_the_image_processor_applies_it(saved, tmp_path, processor, kwargs, expected):
    directory = _edited(saved("vit_classifier")[1], tmp_path)
    getattr(transformers, processor)(**kwargs).save_pretrained(directory)
    imported = import_transformers(directory)
    cfg = imported.model.cfg
    assert {key: getattr(cfg, key) for key in expected} == expected
    assert processor in imported.read["preprocessing"]
    # the same image through transformers' processor and deploykit's preprocessing
    frame = np.random.default_rng(0).integers(0, 256, (45, 60, 3), dtype=np.uint8)
    theirs = getattr(transformers, processor).from_pretrained(directory)(frame, return_tensors="np")["pixel_values"][0]
    ours = cfg.preprocessing(frame, NATIVE)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).mean() < 0.05  # resamplers differ (PIL's vs deploykit's), the geometry may not


def test_preprocessing_that_cannot_be_expressed_is_refused(saved, tmp_path, deploykit_cli):
    directory = _edited(saved("vit_classifier")[1], tmp_path)
    transformers.ViTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(directory)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and "it makes 64x64 inputs but the model's image_size is 32" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ sharded weights


@pytest.fixture(scope="module")
def sharded(saved, tmp_path_factory):
    """The DeiT classifier saved in shards of 20 kB (model.safetensors.index.json + several files)."""
    source = saved("deit_classifier")[0]
    directory = tmp_path_factory.mktemp("sharded")
    source.save_pretrained(directory, max_shard_size="20KB")
    return source, directory


def test_sharded_weights_import_as_transformers_loads_them(sharded, tmp_path, deploykit_cli):
    source, directory = sharded
    assert len(list(directory.glob("model-*.safetensors"))) > 2 and not (directory / "model.safetensors").exists()
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "imported")
    assert code == 0, err
    x = images(WIDE)
    with torch.no_grad():
        assert relative_error(load_model(tmp_path / "imported")(x), reference(source, x)) <= 1e-5


def _index_edited(directory, tmp_path, edit):
    """A copy of a sharded directory whose index's weight_map went through ``edit``."""
    copy = _edited(directory, tmp_path)
    index = copy / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data))
    return copy


def _moved(weight_map):
    """The class token listed in another shard than the one holding it."""
    other = next(shard for shard in weight_map.values() if shard != weight_map["deit.embeddings.cls_token"])
    weight_map["deit.embeddings.cls_token"] = other


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            lambda m: m.update({"deit.layernorm.weight": "../model.safetensors"}),
            "names shard '../model.safetensors'; a shard is a .safetensors",
        ),
        (
            lambda m: m.update({"deit.layernorm.weight": "model-gone.safetensors"}),
            "lists shard 'model-gone.safetensors', which is not a file in",
        ),
        (_moved, "is in it but the index puts it elsewhere"),
        (lambda m: m.clear(), "has no weight_map of tensor names to shard files"),
    ],
)
def test_shards_that_disagree_with_their_index_are_refused(sharded, tmp_path, deploykit_cli, edit, expected):
    directory = _index_edited(sharded[1], tmp_path, edit)
    code, err = deploykit_cli("import", "hf", directory, "-o", tmp_path / "out")
    assert code == 1 and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()

"""timm's own outputs for small configs of every family ``deploykit import timm`` maps, recorded so
CI checks the conversion against timm even where timm cannot be imported.

Why recorded: timm imports torchvision, and PyPI's torchvision for the CPU torch CI pins
(2.13.0) is built against CUDA torch, so it does not import there. Where timm does import,
``tests/nn/test_from_timm.py`` regenerates these outputs live and checks they still hold.

``python tests/nn/timm_reference.py NAME ...`` records only those cases again.

Weights and images come from a counter-based hash (splitmix64 of the element index and the
key's CRC32), not from a framework RNG, so any machine and any torch version rebuilds them
bit for bit from a key and a shape. Regenerate the JSON where timm imports::

    python tests/nn/timm_reference.py

Recorded with timm 1.0.31 (each entry says which), torch 2.14.1 on CPU.

``META_CASES`` are DINOv3 checkpoints in Meta's own layout (github.com/facebookresearch/dinov3),
built here from the seeded weights by the inverse of the key mapping timm's DINOv3 filter
documents (``timm.models.eva.checkpoint_filter_fn``), then loaded by timm itself as a file
(``pretrained_cfg_overlay=dict(file=...)``), so timm's own filter reads them.
"""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

FIXTURE = Path(__file__).with_name("data") / "timm_reference.json"

_TINY = dict(img_size=64, patch_size=8, embed_dim=32, num_heads=2, depth=2)
# EVA-02 keeps its patch size: a 4x4 grid at the native size, positions rescaled to its 16x16 reference grid.
_EVA = dict(depth=2, num_classes=10, dynamic_img_size=True)
# name -> timm.create_model kwargs; resolutions (``resolutions``): native, non-square, larger (, smaller).
CASES: dict[str, dict] = {
    "vit_tiny_patch16_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # class token, APE
    "vit_medium_patch16_reg4_gap_256": dict(_TINY, num_classes=10, dynamic_img_size=True),  # registers, avg + fc_norm, LayerScale
    "deit3_small_patch16_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # LayerScale, no_embed_class
    "vit_small_patch16_rope_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # axial RoPE
    "vit_small_patch16_rope_mixed_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # mixed RoPE
    "vit_small_patch16_rope_mixed_ape_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # mixed RoPE + APE
    "vit_small_patch16_dinov3_qkvb": dict(_TINY),  # DINOv3 RoPE, registers, q/v bias: pooled features
    "vit_small_plus_patch16_dinov3": dict(_TINY, global_pool="token"),  # SwiGLU, class-token features
    "eva02_tiny_patch14_224": dict(_EVA, img_size=56),  # EVA-02 Ti's widths: packed SwiGLU, q/v biases, RoPE on the reference grid + APE
    "eva02_base_patch14_224": dict(_EVA, img_size=56, embed_dim=64, num_heads=2),  # q/k/v projections, SwiGLU + sub-LayerNorm
    "eva02_base_patch16_clip_224": dict(_EVA, img_size=64, embed_dim=64, num_heads=2),  # + attention sub-LayerNorm, class token
    "vit_base_patch16_siglip_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # SigLIP: no class token, attention pooling (map)
    "vit_small_patch16_224": dict(
        _TINY, num_classes=10, dynamic_img_size=True, qk_norm=True, act_layer="gelu_tanh"
    ),  # q/k norms, tanh GELU
    "deit_tiny_distilled_patch16_224": dict(_TINY, num_classes=10, dynamic_img_size=True),  # distillation token and head
}
RESOLUTIONS = ((64, 64), (48, 80), (96, 96))
_PATCH14 = ((56, 56), (42, 70), (84, 84), (42, 42))
CASE_RESOLUTIONS = {
    "eva02_tiny_patch14_224": _PATCH14,
    "eva02_base_patch14_224": _PATCH14,
    "eva02_base_patch16_clip_224": (*RESOLUTIONS, (48, 48)),
}
# DINOv3 files in Meta's layout: name -> timm.create_model kwargs (outputs at RESOLUTIONS).
META_CASES: dict[str, dict] = {
    "vit_base_patch16_dinov3": dict(_TINY),  # the README's example: Meta's zero qkv.bias, which timm's model has no place for
    "vit_small_plus_patch16_dinov3_qkvb": dict(_TINY),  # SwiGLU as w1/w2/w3; q/v biases beside a k third Meta masks
}
# The pretrained_cfg entries timm's eval transform reads (timm.data.resolve_data_config).
PREPROCESSING_KEYS = ("mean", "std", "crop_pct", "crop_mode", "interpolation")
BATCH = 2


def hashed_uniform(shape, key: str) -> torch.Tensor:
    """Uniform in [-1, 1), float64, a pure function of ``key`` and the element index."""
    n = int(np.prod(shape, dtype=np.int64))
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) + np.uint64(zlib.crc32(key.encode()) << 20)
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) / 2.0**52 - 1.0).reshape(shape)


def seeded_state_dict(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Weights for a timm state dict layout: norms' scales near 1, everything else ±0.3."""
    state = {}
    for key, shape in shapes.items():
        u = hashed_uniform(shape, key)
        norm_scale = len(shape) == 1 and key.endswith(".weight") and "norm" in key
        state[key] = (1 + 0.2 * u if norm_scale else 0.3 * u).float()
    return state


def probe_images(resolution: tuple[int, int]) -> torch.Tensor:
    """``[BATCH, 3, H, W]`` float32 inputs, roughly normalised pixels."""
    return hashed_uniform((BATCH, 3, *resolution), f"images{resolution}").float() * 1.7


def tag(resolution: tuple[int, int]) -> str:
    return "x".join(map(str, resolution))


def resolutions(name: str) -> tuple[tuple[int, int], ...]:
    return CASE_RESOLUTIONS.get(name, RESOLUTIONS)


def meta_dinov3_state(timm_state: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """A timm DINOv3 state dict as Meta's code saves it: ``storage_tokens``, ``ls1.gamma``,
    ``qkv.bias`` with its ``bias_mask`` (the k third masked: junk here, which must not matter),
    SwiGLU's ``w1``/``w2``/``w3``, and the ``mask_token`` and ``rope_embed.periods`` a
    pre-training file holds. A model without q/v biases gets Meta's all-zero ``qkv.bias``."""
    swiglu = {".mlp.fc1_g.": ".mlp.w1.", ".mlp.fc1_x.": ".mlp.w2.", ".mlp.fc2.": ".mlp.w3."}
    out = {}
    for key, value in timm_state.items():
        owner, _, leaf = key.rpartition(".")
        if key == "reg_token":
            out["storage_tokens"] = value
        elif leaf in ("gamma_1", "gamma_2"):
            out[f"{owner}.ls{leaf[-1]}.gamma"] = value
        elif leaf == "q_bias":
            k_junk = 0.3 * hashed_uniform(value.shape, f"{owner}.k_bias").float()
            out[f"{owner}.qkv.bias"] = torch.cat([value, k_junk, timm_state[f"{owner}.v_bias"]])
        elif leaf != "v_bias":
            block = key.split(".mlp.")[0]
            is_swiglu = f"{block}.mlp.fc1_g.weight" in timm_state  # Meta's Mlp keeps fc1/fc2
            out[next((key.replace(a, b) for a, b in swiglu.items() if is_swiglu and a in key), key)] = value
        if key.endswith("attn.qkv.weight"):
            width = value.shape[0] // 3
            out[f"{owner}.bias_mask"] = torch.cat([torch.ones(width), torch.zeros(width), torch.ones(width)])
            if f"{owner[: -len('qkv')]}q_bias" not in timm_state:
                out[f"{owner}.bias"] = torch.zeros(3 * width)
    out["mask_token"] = 0.3 * hashed_uniform((1, timm_state["cls_token"].shape[-1]), "mask_token").float()
    out["rope_embed.periods"] = 100.0 ** (4 * torch.arange(head_dim // 4) / head_dim)
    return out


def read_fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def timm_reference(name: str) -> dict:
    """Build timm's ``name`` with the seeded weights and record what deploykit needs (needs timm)."""
    import timm

    from deploykit.nn.from_timm import config_from_timm

    kwargs = CASES[name]
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(seeded_state_dict(shapes))
    with torch.no_grad():
        outputs = {tag(r): model(probe_images(r)).tolist() for r in resolutions(name)}
    # What timm's own eval transform is built from: the pretrained_cfg entries and timm's resolution of them.
    pretrained_cfg = {k: model.pretrained_cfg.get(k) for k in PREPROCESSING_KEYS}
    data_config = {k: v for k, v in timm.data.resolve_data_config(model=model).items() if k in PREPROCESSING_KEYS}
    return dict(
        timm=timm.__version__,
        kwargs=kwargs,
        config=json.loads(json.dumps(config_from_timm(model, name).to_dict())),
        shapes=shapes,
        outputs=outputs,
        pretrained_cfg=json.loads(json.dumps(pretrained_cfg)),
        data_config=json.loads(json.dumps(data_config)),
    )


def meta_reference(name: str) -> dict:
    """timm's ``name`` loading the seeded weights from a file in Meta's DINOv3 layout, through
    timm's own file loading and checkpoint filter, and its outputs (needs timm)."""
    import timm

    kwargs = META_CASES[name]
    shapes = {k: list(v.shape) for k, v in timm.create_model(name, pretrained=False, **kwargs).state_dict().items()}
    seeded = seeded_state_dict(shapes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dinov3.pth"
        torch.save(meta_dinov3_state(seeded, kwargs["embed_dim"] // kwargs["num_heads"]), path)
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()
    # timm's filter took Meta's names back to the seeded weights: the layout above is the one it reads
    loaded = model.state_dict()
    assert loaded.keys() == seeded.keys() and all(torch.equal(loaded[k], v) for k, v in seeded.items())
    with torch.no_grad():
        outputs = {tag(r): model(probe_images(r)).tolist() for r in RESOLUTIONS}
    return dict(timm=timm.__version__, kwargs=kwargs, shapes=shapes, outputs=outputs)


if __name__ == "__main__":
    import sys

    only = sys.argv[1:]  # names to record again, the others kept as recorded (default: all)
    data = read_fixture() if only else {}
    data.update({name: timm_reference(name) for name in (only or CASES)})
    if not only:
        data["dinov3_meta_format"] = {name: meta_reference(name) for name in META_CASES}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")

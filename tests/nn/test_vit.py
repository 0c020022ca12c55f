"""The trunk against timm's layout and an independent functional ViT forward."""

import pytest
import torch
import torch.nn.functional as F

from deploykit.errors import ConfigError, ResolutionError
from deploykit.nn import create_model
from deploykit.nn.spec import deploy_spec

F64 = torch.float64


def timm_vit_small_patch16_224_shapes(depth=12, dim=384, classes=1000):
    """Keys and shapes of timm's vit_small_patch16_224 state dict (timm 1.x, default options)."""
    shapes = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, 197, dim),
        "patch_embed.proj.weight": (dim, 3, 16, 16),
        "patch_embed.proj.bias": (dim,),
        "norm.weight": (dim,),
        "norm.bias": (dim,),
        "head.weight": (classes, dim),
        "head.bias": (classes,),
    }
    for i in range(depth):
        b = f"blocks.{i}."
        shapes.update(
            {
                b + "norm1.weight": (dim,),
                b + "norm1.bias": (dim,),
                b + "attn.qkv.weight": (3 * dim, dim),
                b + "attn.qkv.bias": (3 * dim,),
                b + "attn.proj.weight": (dim, dim),
                b + "attn.proj.bias": (dim,),
                b + "norm2.weight": (dim,),
                b + "norm2.bias": (dim,),
                b + "mlp.fc1.weight": (4 * dim, dim),
                b + "mlp.fc1.bias": (4 * dim,),
                b + "mlp.fc2.weight": (dim, 4 * dim),
                b + "mlp.fc2.bias": (dim,),
            }
        )
    return shapes


def reference_vit(sd, x, heads, depth, eps=1e-6):
    """ViT forward written from the state dict alone (class token, APE, token pooling)."""
    x = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=16)
    x = x.flatten(2).transpose(1, 2)
    if "patch_embed.norm.weight" in sd:  # timm's PatchEmbed(norm_layer=...)
        x = F.layer_norm(x, x.shape[-1:], sd["patch_embed.norm.weight"], sd["patch_embed.norm.bias"], eps)
    x = torch.cat([sd["cls_token"].expand(len(x), -1, -1), x], 1) + sd["pos_embed"]
    B, N, D = x.shape
    hd = D // heads
    for i in range(depth):
        p = lambda n, i=i: sd[f"blocks.{i}.{n}"]
        h = F.layer_norm(x, (D,), p("norm1.weight"), p("norm1.bias"), eps)
        qkv = (h @ p("attn.qkv.weight").T + p("attn.qkv.bias")).reshape(B, N, 3, heads, hd)
        q, k, v = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5, -1) @ v
        x = x + a.transpose(1, 2).reshape(B, N, D) @ p("attn.proj.weight").T + p("attn.proj.bias")
        h = F.layer_norm(x, (D,), p("norm2.weight"), p("norm2.bias"), eps)
        h = F.gelu(h @ p("mlp.fc1.weight").T + p("mlp.fc1.bias"))
        x = x + h @ p("mlp.fc2.weight").T + p("mlp.fc2.bias")
    x = F.layer_norm(x, (D,), sd["norm.weight"], sd["norm.bias"], eps)
    return x[:, 0] @ sd["head.weight"].T + sd["head.bias"]


def test_timm_vit_small_state_dict_loads_and_matches_reference():
    shapes = timm_vit_small_patch16_224_shapes()
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g, dtype=F64) * 0.05 for k, s in shapes.items()}
    model = create_model("vit_small_patch16", encoding="ape").to(F64).eval()
    model.load_state_dict(sd, strict=True)
    assert set(model.state_dict()) == set(shapes)  # saves with timm's names too
    x = torch.randn(2, 3, 224, 224, generator=g, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_vit(sd, x, heads=6, depth=12), atol=1e-10, rtol=1e-10)


def test_embed_norm_is_timms_patch_embed_norm_and_absent_by_default():
    shapes = timm_vit_small_patch16_224_shapes(depth=2)
    shapes.update({"patch_embed.norm.weight": (384,), "patch_embed.norm.bias": (384,)})
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g, dtype=F64) * 0.05 for k, s in shapes.items()}
    sd["patch_embed.norm.weight"] = sd["patch_embed.norm.weight"] + 1
    model = create_model("vit_small_patch16", depth=2, embed_norm=True).to(F64).eval()
    model.load_state_dict(sd, strict=True)
    assert set(model.state_dict()) == set(shapes)
    x = torch.randn(1, 3, 224, 224, generator=g, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_vit(sd, x, heads=6, depth=2), atol=1e-10, rtol=1e-10)
    assert not any(k.startswith("patch_embed.norm") for k in create_model("vit_small_patch16", depth=2).state_dict())


@pytest.mark.parametrize("encoding", ["ape", "rope-axial", "rope-mixed"])
def test_state_dict_round_trip(encoding):
    torch.manual_seed(0)
    a = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64).eval()
    torch.manual_seed(1)
    b = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64).eval()
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(1, 3, 64, 96)
    assert torch.equal(a(x), b(x))


def test_block_outputs_feed_the_head():
    model = create_model("vit_tiny_patch16", encoding="rope-axial", depth=3, img_size=32).eval()
    x = torch.randn(2, 3, 48, 32)
    with torch.no_grad():
        states = model.hidden_states(x, model.tables(model.grid(48, 32), x.dtype))
        assert len(states) == 4 and states[-1].shape == (2, 1 + 6, 192)
        assert torch.equal(model.forward_head(model.norm(states[-1])), model(x))


def test_no_class_token_mean_pools():
    model = create_model("vit_tiny_patch16", encoding="rope-mixed", depth=1, img_size=32, class_token=False).eval()
    assert model.cls_token is None and "cls_token" not in model.state_dict()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        tokens = model.forward_features(x, model.tables((2, 2), x.dtype))
        assert torch.allclose(model(x), model.head(tokens.mean(1)))


@pytest.mark.parametrize("size", [(225, 224), (224, 8), (0, 16)])
def test_resolution_must_be_multiple_of_patch(size):
    model = create_model("vit_tiny_patch16", depth=1)
    with pytest.raises(ResolutionError, match="multiple of the patch size 16"):
        model.grid(*size)


def test_unknown_model_and_bad_config():
    with pytest.raises(ConfigError, match="vit_tiny_patch16"):
        create_model("vit_huge")
    with pytest.raises(ConfigError, match="divisible"):
        create_model("vit_tiny_patch16", num_heads=5)


def test_timm_trunk_options_keep_timm_names_and_pool_as_timm():
    torch.manual_seed(0)
    model = create_model(
        "vit_tiny_patch16",
        encoding="rope-axial",
        depth=2,
        img_size=32,
        num_classes=0,
        reg_tokens=3,
        init_values=1e-5,
        global_pool="avg",
        fc_norm=True,
        mlp_layer="swiglu",
        mlp_hidden_dim=100,
    ).eval()
    keys = set(model.state_dict())
    assert {
        "reg_token",
        "blocks.1.ls1.gamma",
        "blocks.1.ls2.gamma",
        "blocks.0.mlp.fc1_g.weight",
        "blocks.0.mlp.fc1_x.bias",
        "fc_norm.weight",
    } <= keys
    assert not any(k.startswith(("head.", "norm.")) or k == "blocks.0.mlp.fc1.weight" for k in keys)
    assert model.state_dict()["blocks.0.mlp.fc2.weight"].shape == (192, 100)
    assert not deploy_spec(model).answers_top_k
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        tokens = model.hidden_states(x, model.tables((2, 3), x.dtype))[-1]
        assert tokens.shape == (2, 1 + 3 + 6, 192)
        # avg pooling skips the class and register tokens, then fc_norm (timm's global_pool_nlc)
        torch.testing.assert_close(model(x), model.fc_norm(tokens[:, 4:].mean(1)))


def test_eva02_trunk_options_keep_timm_names_and_compute_timms_forward():
    """``swiglu_packed`` (timm's ``GluMlp``: the first half of ``fc1`` gates the second), and the
    sub-LayerNorms ``mlp.norm`` (before fc2) and ``attn.norm`` (before proj), from the weights alone."""
    torch.manual_seed(0)
    options = dict(depth=1, img_size=32, embed_dim=32, num_heads=2, mlp_layer="swiglu_packed", mlp_hidden_dim=24)
    model = create_model("vit_tiny_patch16", **options, mlp_norm=True, attn_norm=True).to(F64).eval()
    for param in model.parameters():  # norms away from the identity, so that they count
        torch.nn.init.normal_(param, std=0.3)
    sd = {k.removeprefix("blocks.0."): v for k, v in model.state_dict().items() if k.startswith("blocks.0.")}
    assert (sd["mlp.fc1.weight"].shape, sd["mlp.norm.weight"].shape, sd["attn.norm.weight"].shape) == ((48, 32), (24,), (32,))
    x = torch.randn(2, 5, 32, dtype=F64)
    gate, value = (x @ sd["mlp.fc1.weight"].T + sd["mlp.fc1.bias"]).split(24, dim=-1)
    hidden = F.layer_norm(F.silu(gate) * value, (24,), sd["mlp.norm.weight"], sd["mlp.norm.bias"], 1e-6)
    block = model.blocks[0]
    with torch.no_grad():
        torch.testing.assert_close(block.mlp(x), hidden @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"])
        q, k, v = (x @ sd["attn.qkv.weight"].T + sd["attn.qkv.bias"]).reshape(2, 5, 3, 2, 16).permute(2, 0, 3, 1, 4)
        heads = (torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v).transpose(1, 2).reshape(2, 5, 32)
        expected = F.layer_norm(heads, (32,), sd["attn.norm.weight"], sd["attn.norm.bias"], 1e-6) @ sd["attn.proj.weight"].T
        torch.testing.assert_close(block.attn(x, model.pos_enc, {}, (2, 2)), expected + sd["attn.proj.bias"])
    plain = create_model("vit_tiny_patch16", **options)  # the defaults add no module and no key
    assert not any(".norm." in k for k in plain.state_dict()) and plain.cfg.to_dict()["mlp_norm"] is False


def test_headless_per_token_features_and_refused_pools():
    model = create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=0, global_pool="").eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 64)).shape == (1, 1 + 8, 192)
    with pytest.raises(ConfigError, match="global_pool must be one of"):
        create_model("vit_tiny_patch16", global_pool="gem")
    with pytest.raises(ConfigError, match="act_layer must be one of"):
        create_model("vit_tiny_patch16", act_layer="relu")
    with pytest.raises(ConfigError, match="act_layer 'gelu_tanh' needs mlp_layer 'mlp'"):
        create_model("vit_tiny_patch16", act_layer="gelu_tanh", mlp_layer="swiglu")
    with pytest.raises(ConfigError, match="distilled needs global_pool 'token', reg_tokens 1"):
        create_model("vit_tiny_patch16", distilled=True)
    with pytest.raises(ConfigError, match="'token' needs class_token true"):
        create_model("vit_tiny_patch16", global_pool="token", class_token=False)
    with pytest.raises(ConfigError, match="mlp_layer must be one of"):
        create_model("vit_tiny_patch16", mlp_layer="geglu")


def _randomised(model):
    for param in model.parameters():  # norms away from the identity, so that they count
        torch.nn.init.normal_(param, std=0.3)
    return model


def _heads_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v


@pytest.mark.parametrize("encoding", ["ape", "rope-axial"])
def test_qk_norm_is_timms_layer_norm_per_head_before_the_rotation(encoding):
    model = _randomised(create_model("vit_tiny_patch16", encoding=encoding, depth=1, img_size=32, embed_dim=32, num_heads=2, qk_norm=True))
    model = model.to(F64).eval()
    sd = {k.removeprefix("blocks.0.attn."): v for k, v in model.state_dict().items() if k.startswith("blocks.0.attn.")}
    assert (sd["q_norm.weight"].shape, sd["k_norm.bias"].shape) == ((16,), (16,))  # timm's names, one head's width
    x = torch.randn(2, 5, 32, dtype=F64)
    q, k, v = (x @ sd["qkv.weight"].T + sd["qkv.bias"]).reshape(2, 5, 3, 2, 16).permute(2, 0, 3, 1, 4)
    q, k = (F.layer_norm(t, (16,), sd[f"{n}.weight"], sd[f"{n}.bias"], 1e-6) for t, n in ((q, "q_norm"), (k, "k_norm")))
    tables = model.tables((2, 2), F64).layers
    tables = tables[0] if tables else {}
    if encoding != "ape":
        q, k = model.pos_enc.apply_qk(q, k, tables)
    expected = _heads_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32) @ sd["proj.weight"].T + sd["proj.bias"]
    with torch.no_grad():
        torch.testing.assert_close(model.blocks[0].attn(x, model.pos_enc, tables, (2, 2)), expected)
    plain = create_model("vit_tiny_patch16", encoding=encoding)
    assert not any("_norm." in k for k in plain.state_dict()) and plain.cfg.to_dict()["qk_norm"] is False


def test_map_pool_is_timms_attention_pool_latent_over_every_token():
    options = dict(depth=1, img_size=32, embed_dim=32, num_heads=2, mlp_hidden_dim=40, class_token=False, num_classes=3)
    model = _randomised(create_model("vit_tiny_patch16", global_pool="map", act_layer="gelu_tanh", **options)).to(F64).eval()
    sd = model.state_dict()
    pool = {k.removeprefix("attn_pool."): v for k, v in sd.items() if k.startswith("attn_pool.")}
    assert {k: tuple(v.shape) for k, v in pool.items()} == {
        "latent": (1, 1, 32),
        **{f"{n}.weight": s for n, s in (("q", (32, 32)), ("kv", (64, 32)), ("proj", (32, 32)), ("norm", (32,)))},
        **{f"{n}.bias": s for n, s in (("q", (32,)), ("kv", (64,)), ("proj", (32,)), ("norm", (32,)))},
        **{"mlp.fc1.weight": (40, 32), "mlp.fc1.bias": (40,), "mlp.fc2.weight": (32, 40), "mlp.fc2.bias": (32,)},
    }
    tokens = torch.randn(2, 4, 32, dtype=F64)  # normed tokens: no prefix, every one attended
    q = (pool["latent"] @ pool["q.weight"].T + pool["q.bias"]).reshape(1, 1, 2, 16).transpose(1, 2)
    k, v = (tokens @ pool["kv.weight"].T + pool["kv.bias"]).reshape(2, 4, 2, 2, 16).permute(2, 0, 3, 1, 4)
    pooled = _heads_attention(q, k, v).transpose(1, 2).reshape(2, 32) @ pool["proj.weight"].T + pool["proj.bias"]
    hidden = F.gelu(
        F.layer_norm(pooled, (32,), pool["norm.weight"], pool["norm.bias"], 1e-6) @ pool["mlp.fc1.weight"].T + pool["mlp.fc1.bias"],
        approximate="tanh",
    )
    pooled = pooled + hidden @ pool["mlp.fc2.weight"].T + pool["mlp.fc2.bias"]
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(tokens), pooled @ sd["head.weight"].T + sd["head.bias"])
        block_mlp = model.blocks[0].mlp  # gelu_tanh is the blocks' activation too
        torch.testing.assert_close(
            block_mlp(tokens),
            F.gelu(tokens @ sd["blocks.0.mlp.fc1.weight"].T + sd["blocks.0.mlp.fc1.bias"], approximate="tanh")
            @ sd["blocks.0.mlp.fc2.weight"].T
            + sd["blocks.0.mlp.fc2.bias"],
        )
    assert not any(k.startswith("attn_pool.") for k in create_model("vit_tiny_patch16").state_dict())


def test_distilled_model_averages_timms_head_and_head_dist():
    options = dict(depth=1, img_size=32, num_classes=3, reg_tokens=1, distilled=True)
    model = _randomised(create_model("vit_tiny_patch16", **options)).to(F64).eval()
    sd = model.state_dict()
    assert (
        "dist_token" in sd and "reg_token" not in sd and sd["head_dist.weight"].shape == (3, 192)
    )  # timm's VisionTransformerDistilled names
    assert (
        deploy_spec(model.cfg).flops((32, 32), 1)
        - deploy_spec(create_model("vit_tiny_patch16", **dict(options, distilled=False)).cfg).flops((32, 32), 1)
        == 2 * 192 * 3
    )
    tokens = torch.randn(2, 6, 192, dtype=F64)
    expected = 0.5 * (tokens[:, 0] @ sd["head.weight"].T + sd["head.bias"] + tokens[:, 1] @ sd["head_dist.weight"].T + sd["head_dist.bias"])
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(tokens), expected)
    again = create_model("vit_tiny_patch16", **options).to(F64)
    again.load_state_dict(sd)  # the timm names load back
    with torch.no_grad():
        x = torch.randn(1, 3, 32, 32, dtype=F64)
        torch.testing.assert_close(again.eval()(x), model(x))


def test_config_without_the_new_fields_means_the_old_trunk():
    # A config.json written before LayerScale/registers/pooled heads existed.
    old = {
        "img_size": 32,
        "patch_size": 16,
        "num_classes": 5,
        "embed_dim": 64,
        "depth": 1,
        "num_heads": 2,
        "class_token": False,
        "encoding": {"name": "ape"},
    }
    from deploykit.nn import ViTConfig

    cfg = ViTConfig.from_dict(old)
    assert (cfg.pool, cfg.num_prefix_tokens, cfg.hidden_dim, cfg.init_values, cfg.fc_norm) == ("avg", 0, 256, None, False)
    assert cfg.embed_norm is False

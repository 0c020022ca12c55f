"""The causal sequence model carrying 1-D MoPE and EGA (MoPE paper's char GPT)."""

import numpy as np
import pytest
import torch

from deploykit.errors import ResolutionError
from deploykit.nn import SequenceConfig, create_model, load_model, save_model
from deploykit.nn.sequence import SequenceTransformer

F64 = torch.float64


def _tokens(batch, length, vocab=65, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "name, encoding, expected",
    # Parameter counts the MoPE digest (§4.2) derives from the authors' script:
    # EGA-MORLET, PE-MORLET and BASE-DOT (learned 256-position embedding, dot attention).
    [("char_gpt_ega", None, 4_763_792), ("char_gpt_dot", None, 4_751_360), ("char_gpt_dot", "ape", 4_816_640)],
)
def test_paper_models_have_the_papers_parameter_counts(name, encoding, expected):
    model = create_model(name, encoding=encoding)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_logits_shape_and_tied_head():
    model = create_model("seq_tiny_ega").eval()
    logits = model(_tokens(2, 17))
    assert logits.shape == (2, 17, 65)
    assert not any(k.startswith("head") for k in model.state_dict())  # one stored copy of the tied weight
    with torch.no_grad():
        model.token_embed.weight[3].mul_(2.0)  # the head reads the same tensor
    assert not torch.equal(model(_tokens(2, 17)), logits)


def _pair(seed=0, **overrides):
    """An EGA model and a dot-attention model holding the same shared weights."""
    torch.manual_seed(seed)
    ega = create_model("seq_tiny_ega", dropout=0.0, **overrides).double().eval()
    dot = create_model("seq_tiny_ega", attention="dot", dropout=0.0, **overrides).double().eval()
    dot.load_state_dict({k: v for k, v in ega.state_dict().items() if ".gate." not in k})
    return ega, dot


def test_ega_with_zero_slope_is_plain_attention():
    ega, dot = _pair()
    tokens = _tokens(3, 40)
    assert not torch.allclose(ega(tokens), dot(tokens), atol=1e-6)  # the gate matters in general
    with torch.no_grad():
        for block in ega.blocks:
            block.attn.gate.alpha.zero_()  # g = 1/2 for every key: cancels after renormalisation
    torch.testing.assert_close(ega(tokens), dot(tokens), atol=1e-12, rtol=0)


def test_training_form_equals_eval_form_without_dropout():
    ega, _ = _pair()
    tokens = _tokens(2, 33)
    with torch.no_grad():
        for block in ega.blocks:  # move the gates off their init so they differ per head
            block.attn.gate.alpha.copy_(torch.tensor([0.5, 2.0, 4.0, -1.0], dtype=F64))
            block.attn.gate.tau.copy_(torch.tensor([0.0, 0.35, -0.5, 1.0], dtype=F64))
        evaluated = ega(tokens)
        ega.train()
        trained = ega(tokens)
    torch.testing.assert_close(trained, evaluated, atol=1e-12, rtol=0)


def test_mope_model_is_causal_prefix_invariant_and_ega_is_not():
    ega, dot = _pair()
    long, short = _tokens(2, 48), _tokens(2, 48)[:, :20]
    with torch.no_grad():
        torch.testing.assert_close(dot(short), dot(long)[:, :20], atol=1e-12, rtol=0)
        # EGA's z-score spans the whole window, future tokens included (digest §3): expected to differ.
        assert (ega(short) - ega(long)[:, :20]).abs().max() > 1e-6


def test_mope_table_is_the_encodings_table_from_position_zero():
    model = create_model("seq_tiny_ega")
    table = model.shape_tables((50,)).model["pos_embed"][0]
    assert table.dtype == F64 and table.shape == (50, 64)
    torch.testing.assert_close(table[0], torch.tensor([1.0, 0.0] * 32, dtype=F64))  # PE(0) = [1, 0, 1, 0, ...]
    torch.testing.assert_close(model.shape_tables((20,)).model["pos_embed"][0], table[:20])  # prefix-consistent
    mask = model.shape_tables((5,)).model["causal_mask"]
    assert torch.equal(torch.isinf(mask), torch.ones(5, 5, dtype=torch.bool).triu(1)) and (mask[~torch.isinf(mask)] == 0).all()


def test_shape_rules():
    mope = create_model("seq_tiny_ega")
    assert mope.check_shape((1024, 1024)) == (1024,)  # "--resolution 1024" parses as a square
    assert mope.check_shape((4096,)) == (4096,)  # MoPE has no length limit
    with pytest.raises(ResolutionError, match="one length"):
        mope.check_shape((384, 256))
    ape = create_model("seq_tiny_ega", encoding="ape", context=64)
    with pytest.raises(ResolutionError, match="covers 64 positions"):
        ape.check_shape((65,))


def test_save_and_load_round_trip(tmp_path):
    model = create_model("seq_tiny_ega", encoding="ape").eval()
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert isinstance(loaded, SequenceTransformer) and loaded.cfg == model.cfg
    tokens = _tokens(2, 30)
    assert torch.equal(loaded(tokens), model(tokens))
    assert SequenceConfig.from_dict(model.cfg.to_dict()) == model.cfg


def test_config_rejects_other_encodings_and_attentions():
    from deploykit.errors import ConfigError

    with pytest.raises(ConfigError, match="mope and ape"):
        create_model("seq_tiny_ega", encoding="rope-axial")
    with pytest.raises(ConfigError, match="attention"):
        create_model("seq_tiny_ega", attention="linear")


def test_real_token_inputs_are_text_in_the_char_vocabulary():
    from deploykit.inputs.builtin import CHAR_VOCAB, real_token_inputs

    tokens = real_token_inputs(300, 65, count=3)
    assert tokens.shape == (3, 300) and tokens.dtype == np.int64
    text = "".join(CHAR_VOCAB[i] for i in tokens[0])
    assert "better than" in text  # the Zen of Python, decoded

import pytest
import torch

from deploykit.errors import CheckpointError
from deploykit.nn import create_model, load_checkpoint, load_model, save_model


def small(**kw):
    return create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=7, **kw).eval()


@pytest.mark.parametrize("encoding", ["ape", "rope-mixed"])
def test_save_load_round_trip(tmp_path, encoding):
    model = small(encoding=encoding)
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.cfg == model.cfg
    x = torch.randn(1, 3, 32, 48)
    assert torch.equal(loaded(x), model(x))
    assert not list((tmp_path / "m").glob(".*tmp"))  # no temporary files left


def test_pt_state_dict_and_wrapped(tmp_path):
    model = small()
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w.pt")
    loaded = load_model(tmp_path / "w.pt", config=model.cfg)
    assert torch.equal(loaded.head.weight, model.head.weight)


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_pt_with_pickled_code_is_refused(tmp_path):
    torch.save({"w": torch.zeros(1), "obj": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only.*Unsupported global.*print") as err:
        load_checkpoint(tmp_path / "evil.pt")
    assert "\n" not in str(err.value)


def test_missing_corrupt_and_unknown_format(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tmp_path / "bad.safetensors")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unsupported"):
        load_checkpoint(tmp_path / "w.npz")


def test_weights_that_do_not_fit(tmp_path):
    save_model(small(), tmp_path / "m")
    wider = create_model("vit_tiny_patch16", depth=2, img_size=32, num_classes=7)
    with pytest.raises(CheckpointError, match="missing blocks.1"):
        load_model(tmp_path / "m" / "model.safetensors", config=wider.cfg)
    other = create_model("vit_small_patch16", depth=1, img_size=32, num_classes=7)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model(tmp_path / "m" / "model.safetensors", config=other.cfg)


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("patch_size", 0), ("depth", "x"), ("img_size", -32)])
def test_invalid_sizes_in_config_json(tmp_path, field, value):
    import json

    save_model(small(), tmp_path / "m")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    data[field] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"config.json.*{field}"):
        load_model(tmp_path / "m")

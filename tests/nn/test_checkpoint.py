import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from deploykit.errors import CheckpointError
from deploykit.nn import create_model, load_checkpoint, load_model, save_model
from deploykit.nn.checkpoint import read_training_checkpoint


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
    """Unpickling it runs ``open(marker, "w")``, which creates the marker: visible proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("where", ["beside the weights", "inside the script's args"])
def test_pt_with_pickled_code_is_refused_and_runs_nothing(tmp_path, where):
    marker = tmp_path / "code-ran"
    args = argparse.Namespace(lr=0.1, hook=Payload(marker)) if where != "beside the weights" else argparse.Namespace(lr=0.1)
    extra = {"obj": Payload(marker)} if where == "beside the weights" else {}
    torch.save({"model": {"w": torch.zeros(1)}, "args": args, **extra}, tmp_path / "evil.pth")
    torch.load(tmp_path / "evil.pth", weights_only=False)  # control: a plain load runs the payload
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=r"weights_only=True: Unsupported global: io.open \(loading it would run code") as err:
        load_checkpoint(tmp_path / "evil.pth")
    assert "\n" not in str(err.value) and not marker.exists()
    assert "weights_only=False" not in str(err.value) and "safe_globals" not in str(err.value)  # no advice to run it


def test_training_script_containers_give_the_trained_weights(tmp_path):
    """DeiT's/GridPE's ``best_checkpoint.pth`` (Namespace args, EMA copy, optimizer, numpy accuracy),
    the MoPE repository's ``model_state``, and a DDP model's ``module.`` names."""
    model, ema = small(), small(encoding="rope-axial")
    deit = {
        "model": model.state_dict(),
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
        "lr_scheduler": {"last_epoch": 3},
        "epoch": 3,
        "model_ema": ema.state_dict(),
        "scaler": {"scale": 65536.0},
        "args": argparse.Namespace(model="deit_small_gridpe", input_size=224, output_dir=Path("out")),
        "max_accuracy": np.float64(81.2),
    }
    torch.save(deit, tmp_path / "best_checkpoint.pth")
    read = read_training_checkpoint(tmp_path / "best_checkpoint.pth")
    assert read.container == "model" and read.args["input_size"] == 224 and read.extras["epoch"] == 3
    assert read.weights.keys() == model.state_dict().keys() and torch.equal(read.weights["head.weight"], model.head.weight)
    assert read.chosen(ema=True).keys() == ema.state_dict().keys()
    assert load_checkpoint(tmp_path / "best_checkpoint.pth").keys() == model.state_dict().keys()  # the trained model, not the EMA

    torch.save({"model_state": model.state_dict(), "optimizer_state": {}, "history": [1.0], "step": 10}, tmp_path / "mope.pt")
    read = read_training_checkpoint(tmp_path / "mope.pt")
    assert read.container == "model_state" and read.extras == {"optimizer_state": {}, "history": [1.0], "step": 10}
    with pytest.raises(CheckpointError, match="holds no EMA weights .*drop --ema"):
        read.chosen(ema=True)

    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "ddp.pth")
    loaded = load_model(tmp_path / "ddp.pth", config=model.cfg)
    assert torch.equal(loaded.head.weight, model.head.weight)
    torch.save({"model": {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "compiled.pth")
    assert load_checkpoint(tmp_path / "compiled.pth").keys() == model.state_dict().keys()  # DDP around torch.compile


def test_a_file_with_no_weights_where_they_should_be_is_named_in_one_line(tmp_path):
    torch.save({"net": {"w": torch.zeros(1)}, "step": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"top-level keys are net, step; expected tensors, or the weights under one of model, "):
        load_checkpoint(tmp_path / "other.pt")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list"):
        load_checkpoint(tmp_path / "list.pt")


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

"""Zoo training: seeded and reproducible, the schedule it claims, and the CLI that saves a model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from deploykit.cli import main
from deploykit.encodings import encoding_name, list_encodings
from deploykit.errors import ConfigError
from deploykit.nn import load_model
from deploykit.zoo.registry import ZOO, get_entry, list_zoo
from deploykit.zoo.train import build_zoo_model, learning_rate, train


def test_every_registered_encoding_has_a_zoo_entry():
    covered = {entry.encoding for entry in ZOO.values()}
    missing = set(list_encodings()) - covered
    assert not missing, f"encodings without a zoo entry: {sorted(missing)}"


@pytest.mark.parametrize("name", list_zoo())
def test_zoo_entry_builds_the_configured_trunk(name):
    entry = get_entry(name)
    model = build_zoo_model(entry)
    assert encoding_name(model.cfg.encoding) == entry.encoding
    for key, value in entry.encoding_options.items():
        assert getattr(model.cfg.encoding, key) == value
    assert model.cfg.dataset == "shape-relations" and model.cfg.num_classes == 4
    assert sum(p.numel() for p in model.parameters()) * 4 < 4e6  # a few MB in fp32


def test_unknown_zoo_name_lists_choices():
    with pytest.raises(ConfigError, match="shapes-ape"):
        get_entry("shapes-nope")


def test_learning_rate_schedule():
    s = SimpleNamespace(lr=1.0, warmup_steps=10, steps=110)
    assert learning_rate(0, s) == pytest.approx(0.1)
    assert learning_rate(9, s) == pytest.approx(1.0)
    assert learning_rate(60, s) == pytest.approx(0.5)  # half-way through the cosine
    assert learning_rate(35, s) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(110, s) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.slow
def test_training_is_reproducible_and_changes_the_weights(tmp_path):
    a = train("shapes-rope-axial", root=tmp_path / "a", steps=3)
    b = train("shapes-rope-axial", root=tmp_path / "b", steps=3)
    wa, wb = load_model(a.directory).state_dict(), load_model(b.directory).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    torch.manual_seed(get_entry("shapes-rope-axial").train.seed)
    init = build_zoo_model(get_entry("shapes-rope-axial")).state_dict()
    assert not torch.equal(init["blocks.0.attn.qkv.weight"], wa["blocks.0.attn.qkv.weight"])
    assert torch.get_num_threads() >= 1  # restored (train sets its own)


def test_cli_zoo_train_saves_a_loadable_model(tmp_path, capsys):
    main(["zoo", "train", "shapes-ape", "--steps", "2", "--root", str(tmp_path)])
    err = capsys.readouterr().err
    assert "shapes-ape" in err and "val" in err
    directory = tmp_path / "shapes-ape"
    config = json.loads((directory / "config.json").read_text())
    assert config["encoding"]["name"] == "ape" and config["img_size"] == 48
    model = load_model(directory)
    assert model(torch.zeros(1, 3, 96, 96)).shape == (1, 4)


@pytest.mark.parametrize("args", [["train", "shapes-nope"], ["eval", "shapes-ape"]])
def test_cli_zoo_errors_are_one_line(tmp_path, capsys, args):
    with pytest.raises(SystemExit) as exit_:
        main(["zoo", *args, "--root", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert ("choose one of" in err) if args[1] == "shapes-nope" else ("deploykit zoo train shapes-ape" in err)
    assert not any(tmp_path.iterdir())

import dataclasses

import pytest

from deploykit.encodings import config_from_dict, config_to_dict, encoding_name, get_config, list_encodings
from deploykit.errors import ConfigError
from deploykit.nn import create_model

# Every registered encoding must be covered by the suites below; adding one without tests fails here.
TESTED = {"ape", "geope", "gridpe", "mope", "rope-axial", "rope-mixed", "sape2", "sape2+ape", "wepe"}


def test_every_registered_encoding_has_tests():
    untested = set(list_encodings()) - TESTED
    assert not untested, f"registered encodings without tests: {sorted(untested)}"


@pytest.mark.parametrize("name", list_encodings())
def test_config_round_trips_with_its_name(name):
    config = get_config(name)
    data = config_to_dict(config)
    assert data["name"] == name
    assert config_from_dict(data) == config
    assert encoding_name(config) == name


@pytest.mark.parametrize("name", list_encodings())
def test_model_config_records_encoding(name):
    model = create_model("vit_tiny_patch16", encoding=name, depth=1, img_size=32)
    assert model.cfg.to_dict()["encoding"]["name"] == name
    assert type(model.cfg).from_dict(model.cfg.to_dict()) == model.cfg


def test_unknown_encoding_lists_choices():
    with pytest.raises(ConfigError, match="ape.*rope-axial"):
        get_config("wepe-typo")


def test_unknown_option_lists_valid_options():
    with pytest.raises(ConfigError, match="theta"):
        get_config("rope-axial", nonsense=1)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_config("ape").interpolation = "nearest"


@pytest.mark.parametrize("name,options", [("rope-axial", {"theta": 10.0}), ("rope-mixed", {"theta": 100.0})])
def test_non_default_options_keep_their_name(name, options):
    config = get_config(name, **options)
    assert encoding_name(config) == name
    assert config_from_dict(config_to_dict(config)) == config


def test_variant_fields_are_fixed_by_the_name():
    with pytest.raises(ConfigError, match="valid options"):
        get_config("rope-axial", mode="mixed")
    with pytest.raises(ConfigError, match="contradicts"):
        config_from_dict({"name": "rope-axial", "mode": "mixed", "theta": 100.0})

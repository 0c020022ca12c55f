import ast
from pathlib import Path

import pytest

from deploykit.encodings import config_from_dict, config_to_dict, encoding_name, get_config, list_encodings
from deploykit.errors import ConfigError
from deploykit.nn import create_model

HERE = Path(__file__).parent


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@pytest.mark.parametrize("name", list_encodings())
def test_every_registered_encoding_has_tests(name):
    """By convention ``deploykit/encodings/<module>.py`` is tested by ``tests/encodings/test_<module>.py``,
    which names each encoding that module registers: derived from the registry, so an encoding
    registered without tests (a new module, or a new name in an old one) fails here."""
    module = type(create_model("vit_tiny_patch16", encoding=name, depth=1, img_size=32).pos_enc).__module__
    test_module = HERE / f"test_{module.rsplit('.', 1)[-1]}.py"
    assert test_module.is_file(), f"{name} is registered in {module}, which has no {test_module.name}"
    assert name in _string_constants(test_module), f"{test_module.name} never names the encoding {name!r}"


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


@pytest.mark.parametrize("name", list_encodings())
def test_every_option_parses_from_the_command_line(name):
    """``--set key=value`` for every field of every encoding: its default, written out, reads back."""
    from deploykit.encodings import parse_options

    defaults = config_to_dict(get_config(name))
    defaults.pop("name")
    parsed = {}
    for key, value in defaults.items():
        try:
            parsed.update(parse_options(name, [f"{key}={'none' if value is None else value}"]))
        except ConfigError as err:  # the variant fields fixed by the name (rope's mode, sape2's ape)
            assert "has no option" in str(err), err
    assert get_config(name, **parsed) == get_config(name)
    assert all(type(parsed[k]) is type(defaults[k]) for k in parsed)


def test_option_values_are_typed_and_checked():
    from deploykit.encodings import parse_options

    assert parse_options("ape", ["antialias=False", "interpolation=bilinear"]) == {"antialias": False, "interpolation": "bilinear"}
    assert parse_options("sape2", ["npos_max=none", "gate_scale=0.5", "npos_max=9"]) == {"npos_max": 9, "gate_scale": 0.5}
    assert parse_options("rope-axial", ["theta=10", "angle_scale=6.25"]) == {"theta": 10.0, "angle_scale": 6.25}
    with pytest.raises(ConfigError, match="option npos_max='2.5' is not a valid int"):
        parse_options("sape2", ["npos_max=2.5"])
    with pytest.raises(ConfigError, match="encoding 'rope-axial' has no option 'mode'; valid options: angle_scale, antialias, ape"):
        parse_options("rope-axial", ["mode=mixed"])  # fixed by the name

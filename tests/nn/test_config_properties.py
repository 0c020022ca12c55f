"""Any ``config.json`` either loads or is refused in one line naming the field: never a traceback,
never a value that crashes later (issue 23).

Property-based (hypothesis): a valid config of each architecture (the small ViT of ``test_cli``
and ``seq_tiny_ega``) with up to three fields replaced by arbitrary JSON (edge numbers, NaN, huge
integers, strings, objects, lists nested past what Python's JSON reader recurses to), required
fields removed, unknown fields added, and the encoding replaced or given arbitrary options. A
fixed example budget, derandomized: the same examples on every run and machine, no deadline.
"""

from __future__ import annotations

import dataclasses
import json

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploykit._fields import show
from deploykit.encodings import get_config, list_encodings
from deploykit.errors import CheckpointError
from deploykit.nn import create_model
from deploykit.nn.checkpoint import check_config_fits, read_config
from deploykit.nn.factory import config_from_dict
from tests.test_cli import small_model

EXAMPLES = settings(max_examples=250, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _tiny_sequence_model():
    torch.manual_seed(0)
    return create_model("seq_tiny_ega").eval()


BASES = {"vit": small_model(), "sequence": _tiny_sequence_model()}
CONFIGS = {name: model.cfg.to_dict() for name, model in BASES.items()}
STATES = {name: model.state_dict() for name, model in BASES.items()}

EDGE_NUMBERS = [0, 1, 2, 3, 16, 32, 64, 1 << 16, (1 << 16) + 1, 10**9, -(10**9), 2**63, 10**30, -1, 10**400, -(10**400)]
EDGE_FLOATS = [0.0, -0.0, 1e-6, 1e-39, 1e-30, 0.5, 4.0, 64.0, 64.5, 1e38, 1e300, float("nan"), float("inf"), -float("inf")]
NUMBERS = st.one_of(
    st.integers(-3, 70_000), st.sampled_from(EDGE_NUMBERS), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(EDGE_FLOATS)
)
WORDS = ["ape", "mope", "token", "avg", "", "mlp", "swiglu", "shape-relations", "bicubic", "axial", "ega", "dot", "true"]
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12), st.sampled_from(WORDS))
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8
)


class Deep:
    """A list nested ``depth`` levels, written into the file as text (``json.dumps`` would recurse)."""

    def __init__(self, depth: int):
        self.depth = depth


VALUES = st.one_of(JSON, st.lists(NUMBERS, max_size=5), st.integers(2, 100_000).map(Deep))
OPTION_NAMES = sorted({f.name for name in list_encodings() for f in dataclasses.fields(get_config(name))})
ENCODINGS = st.one_of(
    VALUES,
    st.builds(
        lambda name, options: {"name": name, **options},
        st.one_of(st.sampled_from(list_encodings()), SCALARS),
        st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=2),
    ),
)


@st.composite
def edited_configs(draw):
    """``(architecture, config dict, the names an edit touched)``."""
    architecture = draw(st.sampled_from(sorted(CONFIGS)))
    data = dict(CONFIGS[architecture])
    fields = sorted(set(data) - {"encoding", "architecture"})
    changes = draw(st.dictionaries(st.sampled_from(fields), VALUES, max_size=3))
    touched = set(changes)
    if draw(st.booleans()):
        changes["encoding"] = draw(ENCODINGS)
        touched |= {"encoding", *(changes["encoding"] if isinstance(changes["encoding"], dict) else ())}
    data.update(changes)
    # (not "architecture": without it a sequence config is read as a ViT's, and refused for the
    # fields a ViT has not, which names those fields rather than the one removed)
    for name in draw(st.sets(st.sampled_from(sorted(set(data) - {"architecture"})), max_size=2)):
        data.pop(name)
        touched.add(name)
    unknown = draw(st.one_of(st.none(), st.text(min_size=1, max_size=10)))
    if unknown is not None and unknown not in data:
        data[unknown] = draw(SCALARS)
        touched.add(unknown)
    return architecture, data, touched


def _json_text(data: dict) -> str:
    """``data`` as ``config.json`` (NaN and Infinity as Python writes them), deep lists spelt out."""
    deep = {}

    def placeholder(value):
        if isinstance(value, Deep):
            deep[f"@deep{len(deep)}@"] = "[" * value.depth + "]" * value.depth
            return list(deep)[-1]
        raise TypeError(type(value).__name__)

    text = json.dumps(data, default=placeholder)
    for key, nested in deep.items():
        text = text.replace(json.dumps(key), nested)
    return text


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "config.json"


@EXAMPLES
@given(edited=edited_configs())
def test_any_config_json_loads_or_is_refused_in_one_line_naming_the_field(config_path, edited):
    architecture, data, touched = edited
    config_path.write_text(_json_text(data))
    try:
        config = read_config(config_path)
    except CheckpointError as err:
        hypothesis.event("refused")
        message = str(err)
        assert "\n" not in message and len(message) < 1000, message
        assert any(name and (name in message or show(name) in message) for name in touched), f"{message!r} names none of {sorted(touched)}"
        return
    hypothesis.event("loaded")
    # It loaded: what it says is a model that can exist. Saved and read back it is the same
    # config, and the weights are matched against it (on the meta device) without any error but
    # the one-line refusal of weights that do not fit.
    assert config_from_dict(json.loads(json.dumps(config.to_dict()))) == config
    try:
        check_config_fits(config, STATES[architecture], config_path)
    except CheckpointError as err:
        assert "\n" not in str(err), str(err)


def test_the_unedited_configs_load():
    """Control for the property: the bases are valid, so a refusal comes from the edit."""
    for architecture, data in CONFIGS.items():
        assert config_from_dict(json.loads(_json_text(data))).to_dict() == json.loads(json.dumps(data)), architecture


def test_the_strategy_reaches_both_outcomes(config_path):
    """Control: the budget explores accepted configs and refusals alike (else the property proves little)."""
    outcomes = set()

    @EXAMPLES
    @given(edited=edited_configs())
    def classify(edited):
        config_path.write_text(_json_text(edited[1]))
        try:
            read_config(config_path)
            outcomes.add("loaded")
        except CheckpointError:
            outcomes.add("refused")

    classify()
    assert outcomes == {"loaded", "refused"}

"""``tables_nest``: an encoding that claims it has a smaller grid's tables equal to the top-left
crop of a larger grid's, checked on a non-square pair; the ones that resize or normalise do not claim it."""

import pytest
import torch

from deploykit.encodings import get_config, list_encodings
from deploykit.nn import create_model

NESTING = {"rope-axial", "rope-mixed", "gridpe", "geope"}


def _encoding(name, **options):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=get_config(name, **options), depth=2).pos_enc


@pytest.mark.parametrize("name", list_encodings())
def test_claim_matches_the_tables(name):
    enc = _encoding(name)
    assert enc.tables_nest == (name in NESTING)
    if not enc.tables_nest:
        with pytest.raises(NotImplementedError):
            enc.crop_tables(enc.tables((9, 11)), (9, 11), (5, 7))
        return
    with torch.no_grad():
        cropped, direct = enc.crop_tables(enc.tables((9, 11)), (9, 11), (5, 7)), enc.tables((5, 7))
    pairs = list(zip(cropped.model.values(), direct.model.values()))
    pairs += [(a, b) for la, lb in zip(cropped.layers, direct.layers) for a, b in zip(la.values(), lb.values())]
    assert pairs
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, options", [("gridpe", {"coords": "normalized"}), ("geope", {"coords": "center"})])
def test_grid_dependent_coordinates_do_not_nest(name, options):
    enc = _encoding(name, **options)
    assert not enc.tables_nest
    # ...and indeed they do not: the crop differs from the tables built for the small grid.
    big, small = enc.tables((9, 11)), enc.tables((5, 7))
    prefix = enc.dims.num_prefix_tokens
    first_big = next(iter(big.layers[0].values()))[..., prefix:, :]
    first_small = next(iter(small.layers[0].values()))[..., prefix:, :]
    lead, width = first_big.shape[:-2], first_big.shape[-1]
    crop = first_big.reshape(*lead, 9, 11, width)[..., :5, :7, :].reshape(*lead, 35, width)
    assert not torch.allclose(crop, first_small)

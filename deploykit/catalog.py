"""What deploykit offers, by name, without importing PyTorch: for ``deploykit list``.

Registration stays where it is: ``@register_encoding`` in each encoding module, the size tables
in ``deploykit.nn`` (both need PyTorch to import). These are their names, so listing them takes
no PyTorch start-up; ``tests/test_catalog.py`` holds them equal to the registries, so adding an
encoding or a model size without naming it here fails the tests.
"""

ENCODINGS = ("ape", "geope", "gridpe", "mope", "rope-axial", "rope-mixed", "sape2", "sape2+ape", "wepe")
MODELS = (
    "char_gpt_dot",
    "char_gpt_ega",
    "seq_tiny_ega",
    "vit_base_patch16",
    "vit_base_patch4_32",
    "vit_small_patch16",
    "vit_small_patch16_4heads",
    "vit_small_patch4_32",
    "vit_tiny_patch16",
)

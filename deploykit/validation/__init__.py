"""Validation: exported graphs against the float64 PyTorch reference, and what explains a failure.

``run``: ``validate()``, every graph of an export directory by its plan's criteria
(``deploykit.checks``); ``bundle``: the replayable bundle ``validate --bundle`` writes, with
``replay_script`` (copied into it, deploykit-free); ``layer_map``: the first divergent layer in the
engine's own terms; ``precision_debug``: which products a cast plan must keep in fp32.
"""

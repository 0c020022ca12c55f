"""Model inputs, numpy only: what deploykit feeds a model to validate, profile and calibrate it.

``kinds``: what a model takes (images or token ids), handed over by the model itself;
``builtin``: inputs when the user gives none (bundled sample images, seeded noise, a zoo model's
own dataset, text for sequence models); ``user``: a user's own folders, image lists and arrays;
``datasets``: the procedurally rendered datasets the zoo trains on.
"""

"""Several optimization profiles per engine, and the one that fits each call.

An engine has one input (``images [B, C, H, W]`` or ``tokens [B, T]``). Each profile gives that
input's ``[min, opt, max]`` shapes. ``deploykit build --profile`` names them as batch ranges
(``1-4``, ``5-32``) and, for a graph exported over a resolution range, resolution buckets
(``1-8@32-48``: batches 1-8 at 32 to 48 px); ``--profiles-from-resolutions`` derives one per
resolution the export names inside a range graph. The fingerprint records every profile
(``build.profiles``), so the runners (``choose_profile``) and ``package triton`` (its config lists
every profile, since Triton uses profile 0 unless told) decide from the record, before any engine
is deserialized.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from deploykit.errors import ConfigError, DeployKitError

Shape = tuple[int, ...]
ProfileShapes = tuple[Shape, Shape, Shape]  # the input's full [min, opt, max] shapes, batch first

_SPEC = re.compile(r"(?P<b0>\d+)-(?P<b1>\d+)(?:@(?P<r0>\d+)-(?P<r1>\d+))?")


@dataclass(frozen=True)
class ProfileRequest:
    """One profile as the user names it: a batch range, and for a range graph a (square)
    resolution range; ``None`` keeps the graph's own resolution (or its whole range)."""

    batches: tuple[int, int]
    resolutions: tuple[int, int] | None = None

    @classmethod
    def parse(cls, spec: str) -> ProfileRequest:
        """``"1-8"`` or ``"1-8@32-48"``.

        Raises:
            ConfigError: not of that form, or a range whose low end is above its high end or 0.
        """
        match = _SPEC.fullmatch(spec.strip())
        if match is None:
            raise ConfigError(f"--profile {spec!r} is not BATCH-BATCH or BATCH-BATCH@RES-RES (e.g. 1-8 or 1-8@32-48)")
        b0, b1 = int(match["b0"]), int(match["b1"])
        res = (int(match["r0"]), int(match["r1"])) if match["r0"] else None
        if not 1 <= b0 <= b1 or (res is not None and not 1 <= res[0] <= res[1]):
            raise ConfigError(f"--profile {spec!r}: each range needs 1 <= low <= high")
        return cls((b0, b1), res)

    def shapes(self, sample: Sequence[int], opt_batch: int, graph_range: tuple[Shape, Shape] | None, tuned: Shape) -> ProfileShapes:
        """The input's ``[min, opt, max]`` for a graph whose per-sample shape is ``sample``
        (``[C, H, W]``; a range graph's ``H, W`` are its dynamic dims, replaced here), tuned for ``opt_batch`` when the batch range holds it, else for the range's
        largest batch, and for resolution ``tuned`` (clamped into the bucket); ``graph_range`` is
        a range graph's ``(min, max)`` resolution.

        Raises:
            ConfigError: a resolution bucket for a graph of one resolution, or outside its range.
        """
        low_b, high_b = self.batches
        batches = (low_b, opt_batch if low_b <= opt_batch <= high_b else high_b, high_b)
        if graph_range is None:
            if self.resolutions is not None:
                raise ConfigError(f"--profile {self.describe()}: a resolution bucket needs a graph exported over a resolution range")
            return tuple((b, *sample) for b in batches)  # type: ignore[return-value]
        low, high = (tuple(r) for r in graph_range)
        if self.resolutions is not None:
            r0, r1 = self.resolutions
            if r0 < min(low) or r1 > max(high):
                raise ConfigError(f"--profile {self.describe()} leaves the graph's range {low} to {high}")
            low, high = (r0, r0), (r1, r1)
        opt = tuple(min(max(t, lo), hi) for t, lo, hi in zip(tuned, low, high))
        lead = tuple(sample[:-2])
        return tuple((b, *lead, *res) for b, res in zip(batches, (low, opt, high)))  # type: ignore[return-value]

    def describe(self) -> str:
        text = f"{self.batches[0]}-{self.batches[1]}"
        return text + (f"@{self.resolutions[0]}-{self.resolutions[1]}" if self.resolutions else "")


def profiles_from_resolutions(
    resolutions: Sequence[Shape], graph_range: tuple[Shape, Shape], batches: tuple[int, int]
) -> list[ProfileRequest]:
    """One profile per bucket between consecutive exported resolutions inside a range graph
    (each from one resolution to the next; the last from the highest exported to the range's
    top), all with the batch range ``batches``.

    Raises:
        ConfigError: fewer than two distinct resolutions inside the range (one profile is the default).
    """
    low, high = min(graph_range[0]), max(graph_range[1])
    sides = sorted({max(r) for r in resolutions if low <= min(r) and max(r) <= high} | {low, high})
    if len(sides) < 3:
        raise ConfigError(
            f"--profiles-from-resolutions: the export names no resolution strictly inside the range {low}-{high}; "
            "give the buckets with --profile"
        )
    return [ProfileRequest(batches, (a, b)) for a, b in zip(sides, sides[1:])]


def fits(profile: ProfileShapes, shape: Sequence[int]) -> bool:
    """Whether an input of ``shape`` lies within ``profile``'s min and max, dim by dim."""
    low, _, high = profile
    return len(shape) == len(low) and all(lo <= d <= hi for lo, d, hi in zip(low, shape, high))


def choose_profile(profiles: Sequence[ProfileShapes], shape: Sequence[int]) -> int:
    """The index of the profile a call of input ``shape`` runs in: of those that fit it, the
    tightest (smallest max volume: kernels tuned nearest the call), the first on a tie.

    Raises:
        DeployKitError: no profile fits, naming each one's range.
    """
    fitting = [i for i, p in enumerate(profiles) if fits(p, shape)]
    if not fitting:
        ranges = "; ".join(f"{i}: {list(p[0])} to {list(p[2])}" for i, p in enumerate(profiles))
        raise DeployKitError(f"no optimization profile of the engine takes an input of shape {list(shape)} (profiles {ranges})")
    return min(fitting, key=lambda i: (_volume(profiles[i][2]), i))


def batch_range(profiles: Sequence[ProfileShapes]) -> tuple[int, int]:
    """The smallest and largest batch any profile takes."""
    return min(p[0][0] for p in profiles), max(p[2][0] for p in profiles)


def recorded_profiles(build: dict, shapes: dict[str, list[list[int]]]) -> list[ProfileShapes]:
    """The profiles a fingerprint records: ``build["profiles"]`` when several were built, else the
    one of its ``shapes`` (fingerprints written before several profiles were possible)."""
    listed = build.get("profiles") or [next(iter(shapes.values()))]
    return [tuple(tuple(int(d) for d in s) for s in p) for p in listed]  # type: ignore[misc]


def _volume(shape: Shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out

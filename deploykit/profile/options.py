"""What one ``profile()`` run measures and how: one record, built by the CLI from its flags or by
a caller from keywords, and handed down whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from deploykit.backends.plugins import Plugins
from deploykit.profile import defaults
from deploykit.profile.report import FP32
from deploykit.profile.timing import Budget


@dataclass(frozen=True)
class ProfileOptions:
    """The settings of one profile run.

    Attributes:
        resolutions: ``(height, width)`` pairs (a sequence model: lengths); empty: every
            resolution of the export directory profiled, else the model's own.
        batches: batch sizes.
        backends: names from the table of backends (``deploykit.runners.table``), ``torch`` included.
        precisions: precision plans the ONNX runners time, interleaved; empty: every plan of the
            export directory profiled, else fp32. PyTorch eager runs fp32 only.
        budget: time per measurement.
        compare_ape: add the same trunk with a learned APE when no APE model is given, and
            report every encoding's latency as a ratio to it.
        end_to_end: also time preprocessing + copies + model + top-5 per batch.
        device: ``auto``, ``cpu`` or ``cuda`` for PyTorch (ONNX runners pick their own providers).
        label: the model's name in the report; empty: the export directory's path.
        plugins: for engine backends, the plugins the engines were built with; None: the
            installed plugin packages each engine's fingerprint names.
        cuda_graphs: engine backends replay CUDA graphs where the engine allows it.
        allow_cpu_fallback: ``ort-cuda`` accepts nodes ONNX Runtime runs on the CPU (records
            name them in ``node_placement``); refused by default.
        validate_plans: check every ONNX-runner target against the PyTorch reference before
            timing it, and mark each cell's fastest validated plan (``deploykit.profile.choice``).
        measure_streams: for an export directory's choice, also measure whether several inference
            streams raise each chosen CPU plan's throughput under concurrent calls
            (``deploykit.profile.streams``), and record the streams it is served with.
    """

    resolutions: Sequence[tuple[int, ...]] = ()
    batches: Sequence[int] = defaults.BATCHES
    backends: Sequence[str] = defaults.BACKENDS
    precisions: Sequence[str] = ()
    budget: Budget = Budget()
    compare_ape: bool = True
    end_to_end: bool = True
    device: str = defaults.DEVICE
    label: str = ""
    plugins: Plugins | None = None
    cuda_graphs: bool = True
    allow_cpu_fallback: bool = False
    validate_plans: bool = True
    measure_streams: bool = True

    def settled(self, resolutions: Sequence[tuple[int, ...]], precisions: Sequence[str], label: str) -> ProfileOptions:
        """These options with the defaults taken from what is profiled: ``resolutions``,
        ``precisions`` and ``label`` fill the fields left empty."""
        return replace(
            self,
            resolutions=tuple(tuple(r) for r in (self.resolutions or resolutions)),
            precisions=tuple(self.precisions or precisions or (FP32,)),
            batches=tuple(self.batches),
            backends=tuple(self.backends),
            label=self.label or label,
        )

    @property
    def runner_options(self) -> dict:
        """What every runner factory of ``deploykit.backends.registry`` takes."""
        return dict(plugins=self.plugins, cuda_graph=self.cuda_graphs, allow_cpu_fallback=self.allow_cpu_fallback)

"""One weight set for every resolution's weight-stripped engine.

A weight-stripped engine (``deploykit build --strip-weights``: ``STRIP_PLAN``) carries none of
its refittable weights; they are refitted into it when it is loaded, through TensorRT's
``OnnxParserRefitter`` (``trt_runner.refit_from_onnx``). Each exported graph holds its own copy
of the weights, so refitting each engine from its own graph would keep one copy per resolution.
Instead the build writes, per engine flavour, one weights file beside the graphs
(``model.rtx.weights``, ``export.directory.shared_weights_file``) holding each distinct
initializer of the stripped engines' graphs once, by content: the model's parameters are the
same bytes at every resolution and are stored once; what differs (the positional tables baked
for each resolution) is stored once per distinct table. Beside each engine its refit graph
(``model_224.rtx.refit.onnx``) is its graph with every initializer (but the smallest,
``INLINE_BYTES``) stored as ONNX external data at its place in that file; ``refit_from_file`` reads external data relative to the graph,
so every resolution's engine is refitted from the one file.

The engine's record (``engine_cache.EngineRecord.shared_weights``) names both files with their
sha256, checked before the engine is loaded: a weight set rewritten since (another build added
a resolution and moved the blobs) or edited is refused in one line.

Torch-free (onnx, hashlib).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploykit._io import atomic_path
from deploykit.errors import StaleEngineError
from deploykit.export.directory import refit_graph_file, shared_weights_file

# Smaller tensors stay in the refit graph (ONNX's own default threshold for external data): shape
# operands among them, which ONNX Runtime's shape inference needs inline, and they weigh nothing.
INLINE_BYTES = 1024


@dataclass(frozen=True)
class SharedWeights:
    """Where a weight-stripped engine's weights are, as its record stores them.

    Attributes:
        refit_graph: the refit graph's file name, beside the engine.
        refit_graph_sha256: its sha256.
        weights: the shared weights file's name, beside the graphs.
        weights_sha256: its sha256.
    """

    refit_graph: str
    refit_graph_sha256: str
    weights: str
    weights_sha256: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SharedWeights:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls)})

    def check(self, directory: str | os.PathLike, hint: str) -> Path:
        """The refit graph's path, when it and the weights file are the ones recorded.

        Raises:
            StaleEngineError: either is missing or changed since it was written.
        """
        from deploykit.export.manifest import sha256_file

        directory = Path(directory)
        for name, sha256 in ((self.refit_graph, self.refit_graph_sha256), (self.weights, self.weights_sha256)):
            path = directory / name
            if not path.is_file():
                raise StaleEngineError(f"{path} is missing: the weight-stripped engine is refitted from it; {hint}")
            if sha256_file(path) != sha256:
                raise StaleEngineError(f"{path} changed since the weight-stripped engine's weight set was written; {hint}")
        return directory / self.refit_graph


@dataclass(frozen=True)
class WeightSet:
    """What ``write_weight_set`` wrote.

    Attributes:
        weights: the shared weights file.
        engines: each graph's ``SharedWeights``, by graph path.
        stored_bytes: the weights file's size: each distinct initializer once (those under
            ``INLINE_BYTES`` stay in the refit graphs).
        graph_bytes: the initializer bytes of every graph, counted per graph (what refitting each
            engine from its own graph would keep).
    """

    weights: Path
    engines: dict[Path, SharedWeights]
    stored_bytes: int
    graph_bytes: int

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"{len(self.engines)} weight-stripped engine(s) refitted from {self.weights.name}: "
            f"{self.stored_bytes / mib:.1f} MiB (their graphs' weights: {self.graph_bytes / mib:.1f} MiB)"
        )


def write_weight_set(graphs: Sequence[Path], tag: str) -> WeightSet:
    """Write the one weights file of flavour ``tag`` for ``graphs`` (all in one directory), each
    distinct initializer once, and each graph's refit graph pointing into it (atomically, each
    file; the records that name them are written last, by the caller)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    from deploykit.export.manifest import sha256_file

    directory = Path(graphs[0]).parent
    weights = shared_weights_file(directory, tag)
    placed: dict[str, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)
    refit_protos = {}
    graph_bytes = 0
    with atomic_path(weights) as tmp, open(tmp, "wb") as out:
        for graph in graphs:
            proto = onnx.load(str(graph))  # external data too, if the graph has any
            for tensor in proto.graph.initializer:
                _to_raw(tensor)
                data = tensor.raw_data
                graph_bytes += len(data)
                if len(data) < INLINE_BYTES:
                    continue
                key = hashlib.sha256(data).hexdigest()
                if key not in placed:
                    placed[key] = (out.tell(), len(data))
                    out.write(data)
                offset, length = placed[key]
                set_external_data(tensor, weights.name, offset, length)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
            refit_protos[Path(graph)] = proto
        stored = out.tell()
    engines = {}
    weights_sha256 = sha256_file(weights)
    for graph, proto in refit_protos.items():
        refit = refit_graph_file(graph, tag)
        with atomic_path(refit) as tmp:
            tmp.write_bytes(proto.SerializeToString())
        engines[graph] = SharedWeights(refit.name, sha256_file(refit), weights.name, weights_sha256)
    return WeightSet(weights, engines, stored, graph_bytes)


def _to_raw(tensor) -> None:
    """Hold the tensor's data in ``raw_data`` (what external data stores), whichever field the
    exporter used."""
    if tensor.HasField("raw_data"):
        return
    from onnx import numpy_helper

    raw = numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name)
    tensor.CopyFrom(raw)

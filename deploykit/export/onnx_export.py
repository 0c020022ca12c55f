"""PyTorch → ONNX for one fixed resolution, with the encoding's tables baked as constants.

A "resolution" is the model's input shape: ``(height, width)`` for a ViT, ``(length,)`` for a
sequence model. ``BakedModel`` freezes the encoding's tables for one patch grid (built in float64, stored fp32)
into buffers under ``pe_tables``; the dynamo exporter turns them into initializers named
``pe_tables.<name>``, which the lint recognises (they must stay fp32). The batch dimension is
dynamic; the spatial size is static (one engine per resolution is TensorRT's fastest form).

A resolution range (``resolution_range``) gives one graph with dynamic height and width instead,
for encodings whose tables nest (``PositionalEncoding.tables_nest``: RoPE, GridPE with raw
coordinates, GeoPE from the corner): ``RangeBakedModel`` bakes the largest grid's tables and
crops them to each input's grid inside the graph.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from deploykit._io import atomic_path
from deploykit._terminal import quiet_logger
from deploykit._version import __version__
from deploykit.encodings import KeepsFloat, PETables, config_to_dict
from deploykit.errors import ExportError, ResolutionError
from deploykit.export.custom_ops import CUSTOM_TRANSLATIONS, attach_functions
from deploykit.export.defaults import DEFAULT_OPSET, SUPPORTED_OPSETS
from deploykit.export.lint import check_graph
from deploykit.export.manifest import graph_opset
from deploykit.export.metadata import GraphMetadata
from deploykit.export.names import node_scopes, trunk_scope
from deploykit.export.qk_channels import with_contiguous_qk_channels
from deploykit.graph.canonical import CANONICAL
from deploykit.inputs.resolutions import resolution_tag
from deploykit.nn.factory import Model
from deploykit.nn.spec import block_paths, deploy_spec

# TensorRT's ITensor: "the volume of the tensor must be less than 2^31 elements". Every graph
# here materialises each block's attention scores [batch, heads, T, T], so even at batch 1
# heads * T^2 must stay within it (and past it the host tables alone run to hundreds of GB).
MAX_TENSOR_ELEMENTS = 2**31 - 1
# torch.export refuses to generalise a dimension whose example value is 0 or 1.
_EXAMPLE_BATCH = 2


def check_opset(opset: int) -> int:
    """The opset, or ``ExportError`` stating the supported range and why.

    Raises:
        ExportError: outside ``SUPPORTED_OPSETS``.
    """
    low, high = SUPPORTED_OPSETS[0], SUPPORTED_OPSETS[-1]
    if opset not in SUPPORTED_OPSETS:
        raise ExportError(
            f"opset {opset} is not supported: deploykit exports opsets {low} to {high} ({low} is the first with "
            f"LayerNormalization, {high} the newest TensorRT's ONNX parser reads); the default is {DEFAULT_OPSET}"
        )
    return opset


def check_export_shape(model: Model, resolution: tuple[int, ...]) -> tuple[int, ...]:
    """``model.check_shape(resolution)``, also refusing a shape whose attention scores one
    tensor cannot hold (``MAX_TENSOR_ELEMENTS``), with the bound in the message.

    Raises:
        ResolutionError: the model cannot take the shape, or its graph would be absurdly large.
    """
    resolution = model.check_shape(resolution)
    tokens, heads = model.num_tokens(resolution), model.cfg.num_heads
    scores = heads * tokens**2
    if scores > MAX_TENSOR_ELEMENTS:
        most = math.isqrt(MAX_TENSOR_ELEMENTS // heads)
        raise ResolutionError(
            f"resolution {resolution_tag(resolution)} gives {tokens:,} tokens: each block's attention scores "
            f"[1, {heads}, {tokens}, {tokens}] would hold {scores:.3g} elements ({4 * scores / 1e9:.3g} GB in fp32), "
            f"more than the 2^31-1 TensorRT allows in one tensor; this model takes at most {most:,} tokens"
        )
    return resolution


# One input's attention scores per call up to this size: ONNX Runtime's CPU checks ran fastest per
# input at the largest batch within it (Xeon, 2 cores; rows_per_call).
_SCORES_PER_CALL_BYTES = 8 << 20
_MOST_ROWS_PER_CALL = 32


def rows_per_call(model: Model, resolution: tuple[int, ...]) -> int:
    """How many inputs the exporter's and ``profile``'s checks run per call on the CPU: as many as
    keep one block's fp32 attention scores within 8 MB, at least 1, at most 32: past that size the
    scores leave the caches, and a larger batch costs more per input than it saves in calls.
    """
    tokens, heads = model.num_tokens(model.check_shape(resolution)), model.cfg.num_heads
    return max(1, min(_MOST_ROWS_PER_CALL, _SCORES_PER_CALL_BYTES // (4 * heads * tokens**2)))


class BakedModel(nn.Module):
    """A model with its positional tables frozen for one input shape.

    Args:
        model: the trained trunk (float32, eval mode).
        resolution: ``model.check_shape``'d shape: ``(height, width)`` in pixels, or ``(length,)``.
    """

    def __init__(self, model: Model, resolution: tuple[int, ...]):
        super().__init__()
        self.model = model  # its name is the scope every trunk node is traced in (names.TRUNK_SCOPE)
        self.resolution = resolution
        with torch.no_grad():
            # Built in float64 on the host, stored in fp32 (never fp16).
            tables = model.shape_tables(resolution).map(lambda t: t.detach().float())
        self.pe_tables = nn.Module()
        self._layout = _register_tables(self.pe_tables, tables)

    def baked_tables(self) -> PETables:
        get = lambda name: getattr(self.pe_tables, name)
        return PETables(
            model={k: get(n) for k, n in self._layout.model.items()},
            layers=[{k: get(n) for k, n in layer.items()} for layer in self._layout.layers],
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.model.forward_with_tables(x, self.baked_tables())


class RangeBakedModel(BakedModel):
    """A model with the tables of the largest resolution of a range baked in, cropped in the graph
    to each input's patch grid (only for encodings whose tables nest).

    Args:
        model: the trained trunk (float32, eval mode); a ViT whose encoding has ``tables_nest``.
        largest: the largest ``(height, width)`` of the range.
    """

    def __init__(self, model: Model, largest: tuple[int, int]):
        super().__init__(model, largest)
        self.full_grid = model.grid(*largest)

    def forward(self, x: Tensor) -> Tensor:
        grid = self.model.grid(*x.shape[-2:])
        tables = self.model.pos_enc.crop_tables(self.baked_tables(), self.full_grid, grid)
        return self.model.forward_with_tables(x, tables)


def check_resolution_range(model: Model, low: tuple[int, int], opt: tuple[int, int], high: tuple[int, int]) -> None:
    """Refuse, in one line, a range one graph cannot serve: a sequence model, an encoding whose
    tables do not nest, a shape that is not a multiple of the patch, or ``low <= opt <= high``
    broken on either axis."""
    encoding = config_to_dict(model.cfg.encoding)["name"]
    deploy_spec(model).input_dims((low, high))  # refuses an architecture without a range
    if not model.pos_enc.tables_nest:
        raise ExportError(
            f"{encoding} builds its tables for the whole grid (resized or normalised), so one graph cannot serve "
            "a resolution range; export each resolution (-r) instead"
        )
    for shape in (low, opt, high):
        check_export_shape(model, shape)
    if not all(a <= b <= c for a, b, c in zip(low, opt, high)):
        raise ExportError(f"resolution range needs min <= opt <= max on each axis, got {low}, {opt}, {high}")


def _register_tables(owner: nn.Module, tables: PETables) -> PETables:
    """Register every distinct table once as a buffer; return the same structure holding names.

    Names are deterministic: ``<key>`` for model-level tables and for a tensor all blocks share,
    ``<key>_block<i>`` for per-block tables.
    """
    names: dict[int, str] = {}

    def name_of(key: str, tensor: Tensor, default: str) -> str:
        if id(tensor) not in names:
            names[id(tensor)] = default
            owner.register_buffer(default, tensor.contiguous(), persistent=False)
        return names[id(tensor)]

    model = {k: name_of(k, v, k) for k, v in tables.model.items()}
    layers = []
    for i, layer in enumerate(tables.layers):
        entry = {}
        for key, tensor in layer.items():
            shared = all(other.get(key) is tensor for other in tables.layers)
            entry[key] = name_of(key, tensor, key if shared else f"{key}_block{i}")
        layers.append(entry)
    return PETables(model=model, layers=layers)


def onnx_from_model(
    model: Model,
    resolution: tuple[int, ...],
    opset: int = DEFAULT_OPSET,
    resolution_range: tuple[tuple[int, int], tuple[int, int]] | None = None,
) -> onnx.ModelProto:
    """Export ``model`` at ``resolution`` to an in-memory ONNX model, with metadata, linted.

    With ``resolution_range = (min, max)`` the graph takes any height and width between the two
    (multiples of the patch; ``resolution`` is the shape it is traced and tuned at), its tables
    baked for ``max`` and cropped per input (``RangeBakedModel``).

    Raises:
        ResolutionError: the shape does not fit the model (not a multiple of the patch size, a
            length beyond a learned table).
        ExportError: the exporter failed, the graph failed the lint, or the range cannot be
            served by one graph (``check_resolution_range``).
    """
    check_opset(opset)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        # Export in fp32 without changing the caller's model (buffers such as GridPE's float64
        # omegas stay as they are: tables are built from them in float64 anyway).
        model = copy.deepcopy(model).float()
    resolution = check_export_shape(model, resolution)
    spec = deploy_spec(model)
    example = spec.example_input(resolution, _EXAMPLE_BATCH)
    # The same function with q/k channels in the order the encoding reads as whole slices.
    graph_model, qk_order = with_contiguous_qk_channels(model)
    graph_model.eval()
    if resolution_range is None:
        baked = BakedModel(graph_model, resolution).eval()
    else:
        low, high = (tuple(r) for r in resolution_range)
        check_resolution_range(model, low, resolution, high)
        baked = RangeBakedModel(graph_model, high).eval()
    # The dynamo exporter prints progress lines and warnings about unrelated packages even with
    # verbose=False; keep the CLI quiet and show only our own errors.
    # no_grad: with an attention mask that requires grad (SaPE²'s bias), torch.export records the
    # CPU flash-attention output layout, and its decomposition then fails on the head merge's view.
    # onnxscript's version converter logs a traceback for a conversion it then falls back from;
    # the result is checked (opset, lint) and reported in one line.
    with (
        contextlib.redirect_stdout(io.StringIO()),
        quiet_logger("torch.onnx"),
        quiet_logger("onnxscript"),
        warnings.catch_warnings(),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                baked,
                (example,),
                dynamo=True,
                opset_version=opset,
                input_names=[spec.input_name],
                output_names=list(spec.output_names),
                dynamic_shapes=(spec.input_dims(resolution_range),),
                custom_translation_table=CUSTOM_TRANSLATIONS,
                optimize=True,
                verbose=False,
            )
        except Exception as err:  # the exporter raises many internal types
            if _interrupted(err):  # Ctrl-C inside the exporter, re-raised by it as another error
                raise KeyboardInterrupt from err
            raise ExportError(f"torch.onnx.export failed at {resolution}: {str(err).splitlines()[0]}") from err
    if graph_opset(program.model_proto) != opset:  # the converter gave up and left its own opset
        raise ExportError(f"opset {opset} was asked for, but the exporter wrote opset {graph_opset(program.model_proto)}")
    # Rewrite and fold first: the SaPE2Bias function is attached afterwards, so the optimiser cannot inline it.
    proto = _rewrite_and_fold(program.model_proto)
    attach_functions(proto)
    # qk_order: said, for anyone comparing q/k tensors inside the graph
    _describe(model, resolution, resolution_range, qk_order, proto).write(proto)
    proto.producer_name, proto.producer_version = "deploykit", __version__
    check_graph(proto)
    return proto


# The exporter's optimiser folds only constants up to 8192 elements; a tied LM head's transposed
# embedding (65 × 256 in MoPE's char model) is bigger, and an engine should not transpose a
# constant on every run. Fold anything up to this many elements.
_FOLD_LIMIT = 1 << 24
# The exporter records each node's Python stack trace, with the absolute paths of this install:
# the same weights exported from two checkouts gave two graphs (re-exports keep graphs and their
# engines only when byte-identical), and a shared graph showed the user's paths. The name scopes
# that module paths are read from stay.
_DROPPED_NODE_METADATA = ("pkg.torch.onnx.stack_trace",)


def _rewrite_and_fold(proto: onnx.ModelProto) -> onnx.ModelProto:
    import onnx_ir as ir
    import onnxscript.optimizer

    model = ir.from_proto(proto)
    CANONICAL.apply(model)
    onnxscript.optimizer.optimize(model, input_size_limit=_FOLD_LIMIT, output_size_limit=_FOLD_LIMIT)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key in _DROPPED_NODE_METADATA:
            node.metadata_props.pop(key, None)
    return ir.to_proto(model)


def _interrupted(err: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is among the causes or contexts of ``err``: the exporter
    turns one caught mid-trace into its own ``TorchExportError`` (seen with an ``AttributeError``
    raised while handling the interrupt)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def block_output_names(proto: onnx.ModelProto, scopes: Sequence[str]) -> list[str]:
    """Tensor names of each transformer block's output, found from the exporter's scope metadata.

    A block's output is the tensor produced inside its scope (``scopes``, in block order:
    ``model.blocks.<i>``) and consumed outside it. Recorded at export so validation can compare
    block by block without re-exporting.
    """
    scopes = list(scopes)
    producers: dict[str, str] = {}  # tensor -> block scope that produced it
    for node in proto.graph.node:
        block = _block_scope(node, scopes)
        for out in node.output:
            producers[out] = block
    outputs: dict[str, str] = {}
    consumers = [(node, _block_scope(node, scopes)) for node in proto.graph.node]
    graph_outputs = {o.name for o in proto.graph.output}
    for node, block in consumers:
        for name in node.input:
            source = producers.get(name)
            if source and source != block:
                outputs[source] = name
    for name in graph_outputs:
        if producers.get(name):
            outputs[producers[name]] = name
    names = [outputs.get(scope) for scope in scopes]
    return [n for n in names if n] if all(names) else []


def _block_scope(node: onnx.NodeProto, scopes: Sequence[str]) -> str:
    """The scope of the block the node belongs to, else ``""``."""
    return next((s for s in node_scopes(node) if s in scopes), "")


def _describe(model: Model, resolution: tuple[int, ...], resolution_range, qk_order, proto: onnx.ModelProto) -> GraphMetadata:
    """The graph's own record of what it is."""
    encoding = config_to_dict(model.cfg.encoding)
    return GraphMetadata(
        version=__version__,
        encoding=encoding["name"],
        encoding_config=encoding,
        model_config=model.cfg.to_dict(),
        resolution=tuple(resolution),
        resolution_range=None if resolution_range is None else tuple(tuple(r) for r in resolution_range),
        patch_size=deploy_spec(model).patch_size,
        block_outputs=tuple(block_output_names(proto, [trunk_scope(path) for path in block_paths(model)])),
        # Name scopes that quantized plans keep float.
        float_modules=tuple(sorted(trunk_scope(name) for name, module in model.named_modules() if isinstance(module, KeepsFloat))),
        qk_channel_order=None if qk_order is None else tuple(int(i) for i in qk_order),
    )


def save_onnx(proto: onnx.ModelProto, dest: str | os.PathLike) -> Path:
    """Write an ONNX model atomically (single file; ViTs up to ViT-L stay under protobuf's 2 GB)."""
    with atomic_path(dest) as tmp:
        onnx.save_model(proto, str(tmp))
    return Path(dest)

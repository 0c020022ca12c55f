"""A seeded fuzz of checkpoint files built from allowed globals only, run in a child process.

Each case is a real checkpoint (the recorded GridPE, MoPE and WePE files, a tiny timm-named ViT
for ``import vit`` and for ``export --checkpoint``) with one to three mutations: a tensor seen
through crafted sizes, strides or a storage offset, a zero stride, a meta, sparse, nested or
quantized tensor, another dtype, NaN/Inf values, an odd key or block number, numpy scalars of
flexible or huge dtypes, nesting, ``args`` of the wrong types. ``python checkpoint_fuzz.py SEED
CASES WORKDIR`` writes each case's file, runs its command in-process (as the console script
does) and prints one JSON line per case: the exit code, stderr, a traceback's last line when an
exception escaped, the process's peak resident size after the case, and what the output
directory holds. ``test_checkpoint_fuzz.py`` judges the lines.

The peak resident size (``VmHWM``) only grows, so each case's line holds the peak of every
case so far: a case that allocates beyond the bound shows as the first line over it. An
address-space limit a little above the bound keeps a runaway case from taking the host's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import resource
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

DATA = Path(__file__).with_name("data")
GRIDPE = DATA / "gridpe_best_checkpoint.pth"
MOPE = DATA / "mope" / "exp2_egam.pt"
WEPE = DATA / "wepe" / "best_wef_vit_ti.pth"
# What one case may add to the child's peak resident size, over the peak the controls reach (a
# valid import of each file): the hostile files of issue 52 took 1 to 8.6 GB.
PEAK_GROWTH_BOUND = 256 << 20
# The address space the child may reserve beyond what it holds after the controls: a runaway
# allocation fails inside the case (a traceback, so the test fails) instead of taking the host.
ADDRESS_SPACE_MARGIN = 3 << 30

try:  # numpy 2 (numpy 1 names it numpy.core.multiarray), as a pickle names it
    from numpy._core.multiarray import scalar as _numpy_scalar
except ImportError:
    from numpy.core.multiarray import scalar as _numpy_scalar


class _Dtype:
    """Pickles as ``numpy.dtype(spec, False, True)`` (numpy's own reduction, without its BUILD)."""

    def __init__(self, spec: str):
        self.spec = spec

    def __reduce__(self):
        return (np.dtype, (self.spec, False, True))


class _Scalar:
    """Pickles as numpy's scalar reconstructor given a dtype and (maybe) no bytes."""

    def __init__(self, spec: str, data: bytes | None):
        self.spec, self.data = spec, data

    def __reduce__(self):
        return (_numpy_scalar, (_Dtype(self.spec),) + (() if self.data is None else (self.data,)))


class _Strided:
    """Pickles as ``torch._utils._rebuild_tensor_v2`` over a small real storage with any size,
    stride and offset (what a hand-written pickle may claim)."""

    def __init__(self, storage: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self):
        from collections import OrderedDict

        typed = torch.storage.TypedStorage(wrap_storage=self.storage.untyped_storage(), dtype=self.storage.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2, (typed, self.offset, self.size, self.stride, False, OrderedDict()))


@dataclass
class Case:
    """One fuzzed file and the command that reads it."""

    name: str
    target: str  # gridpe, mope, wepe, vit, export
    mutations: list[str]
    file: Path
    output: Path

    def argv(self) -> list[str]:
        if self.target == "export":
            return ["export", "--checkpoint", str(self.file), "-o", str(self.output), "--resolution", "32"]
        extra = {"vit": ["--model", "vit_tiny_patch16"], "wepe": ["--num-heads", "4", "--img-size", "64"]}.get(self.target, [])
        return ["import", self.target, str(self.file), "-o", str(self.output), *extra]


# ------------------------------------------------------------------------------------------------
# Base files


def _load(path: Path) -> Any:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def _tiny_vit() -> dict[str, torch.Tensor]:
    from deploykit.nn import create_model

    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=3).state_dict()


def base_file(target: str) -> tuple[dict, dict]:
    """``(file object, the state dict inside it)`` for ``target``: the real layout each command reads."""
    if target == "gridpe":
        file = _load(GRIDPE)
        for key in ("optimizer", "lr_scheduler", "scaler"):  # large and never read: kept out to keep the files small
            file.pop(key, None)
        file["args"] = argparse.Namespace(**vars(file["args"]))
        return file, file["model"]
    if target == "mope":
        file = _load(MOPE)
        file.pop("optimizer_state", None)
        return file, file["model_state"]
    if target == "wepe":
        state = dict(_load(WEPE))
        return state, state
    state = _tiny_vit()
    file = {"model": state, "epoch": 3} if target == "vit" else state
    return file, state


# ------------------------------------------------------------------------------------------------
# Mutations: each takes (rng, file, state) and returns a short description


def _some_key(rng: random.Random, state: dict) -> str:
    return rng.choice(sorted((k for k in state if isinstance(k, str) and isinstance(state[k], torch.Tensor)), key=str))


def _huge_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.choice([1, 3, 48, 1 << 10, 1 << 16, 46341, 1 << 20]) for _ in range(rng.randint(1, 3)))


def zero_stride(rng, file, state):
    key = _some_key(rng, state)
    shape = _huge_shape(rng)
    state[key] = torch.ones(1, dtype=torch.float32).reshape((1,) * len(shape)).expand(*shape)
    return f"{key} zero-stride {list(shape)}"


def crafted_strides(rng, file, state):
    key = _some_key(rng, state)
    storage = torch.arange(rng.choice([1, 4, 64]), dtype=torch.float32)
    rank = rng.randint(0, 3)
    size = tuple(rng.choice([0, 1, 2, 7, 1 << 20, 1 << 40]) for _ in range(rank))
    stride = tuple(rng.choice([0, 1, 3, -1, 1 << 30]) for _ in range(rank))
    offset = rng.choice([0, 1, 63, 1 << 40, -1])
    state[key] = _Strided(storage, offset, size, stride)
    return f"{key} size {list(size)} stride {list(stride)} offset {offset}"


def special_tensor(rng, file, state):
    key = _some_key(rng, state)
    kind = rng.choice(["meta", "meta-huge", "sparse", "sparse-csr", "nested", "quantized", "parameter"])
    like = state[key] if isinstance(state[key], torch.Tensor) else torch.zeros(3)
    if kind == "meta":
        value = torch.empty(like.shape, device="meta")
    elif kind == "meta-huge":
        value = torch.empty(1 << 20, 1 << 20, device="meta")
    elif kind == "sparse":
        value = like.float().to_sparse()
    elif kind == "sparse-csr":
        value = torch.zeros(3, 3).to_sparse_csr()
    elif kind == "nested":
        value = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(1)])
    elif kind == "quantized":
        value = torch.quantize_per_tensor(like.float().contiguous(), 0.1, 0, torch.qint8)
    else:
        value = torch.nn.Parameter(like.float().clone(), requires_grad=False)
    state[key] = value
    return f"{key} {kind}"


DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.bool, torch.uint8, torch.complex64]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "uint16", None)) if d is not None]


def other_dtype(rng, file, state):
    key = _some_key(rng, state)
    dtype = rng.choice(DTYPES)
    state[key] = state[key].to(dtype)
    return f"{key} as {dtype}"


def odd_values(rng, file, state):
    key = _some_key(rng, state)
    value = rng.choice([math.nan, math.inf, -math.inf, 3e38, 1e-45])
    tensor = state[key].clone()
    if tensor.is_floating_point() and tensor.numel():
        tensor.view(-1)[rng.randrange(tensor.numel())] = value
    state[key] = tensor
    return f"{key} holds {value}"


def odd_shape(rng, file, state):
    key = _some_key(rng, state)
    tensor = state[key]
    choice = rng.choice(["0-d", "empty", "flat", "transposed", "extra-dim"])
    if choice == "0-d":
        state[key] = torch.tensor(1.0)
    elif choice == "empty":
        state[key] = torch.zeros(0, *tensor.shape[1:])
    elif choice == "flat":
        state[key] = tensor.reshape(-1).clone()
    elif choice == "transposed" and tensor.ndim >= 2:
        state[key] = tensor.transpose(0, -1)
    else:
        state[key] = tensor[None].clone()
    return f"{key} {choice}"


def odd_key(rng, file, state):
    old = _some_key(rng, state)
    index = rng.choice(["99999999", "1000", "-1", "01", "١", "1e3", " 1", "abc", "", "9" * 40])
    new = rng.choice(
        [f"blocks.{index}.norm1.weight", "", "x" * 100_000, "blocks", "blocks.", "é.ü", old + ".", "." + old, old + "\nerror: x"]
    )
    if rng.random() < 0.3:
        new = rng.choice([5, None, (1, 2), b"head.weight"])  # a key that is no string
    state[new] = state.pop(old) if rng.random() < 0.5 else state[old]
    return f"{old} -> {str(new)[:40]!r}"


def shared_storage(rng, file, state):
    key = _some_key(rng, state)
    for i in range(rng.choice([2, 100, 10_000])):
        state[f"{key}.alias{i}"] = state[key]
    return f"{key} under many names"


NUMPY_SPECS = ["V1000000000", "V16", "S1000000000", "U250000000", "O", "c16", "M8[s]", "f16", "(1000000000,)f8", "i8,f8", "f2"]


def numpy_scalars(rng, file, state):
    if file is state:
        return "no container for numpy scalars"
    spec = rng.choice(NUMPY_SPECS)
    file[rng.choice(["best_acc", "max_accuracy", "seed"])] = _Scalar(spec, rng.choice([None, b"", b"\x00" * 8]))
    return f"numpy scalar {spec}"


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


WRONG = [True, -1, 0, 10**100, 2**31, 65536, 65520, 1e308, math.nan, math.inf, "224", b"x", [224], {}, None, 224.5, 0.0, -0.5, 1 + 2j]


def wrong_args(rng, file, state):
    if file is state:
        return "no container for args"
    args = file.get("args")
    if not isinstance(args, argparse.Namespace):
        args = file["args"] = argparse.Namespace(model="gridpe_deit_small_patch16_LS")
    name = rng.choice(["input_size", "nb_classes", "eval_crop_ratio", "num_heads", "model"])
    value = rng.choice([*WRONG, np.float64(224.0), np.int64(10**18), argparse.Namespace(), Path("/dev/zero"), "nested"])
    if value == "nested":
        value = _nested(rng.choice([10, 500]), 224)
    setattr(args, name, value)
    return f"args.{name} = {str(value)[:30]}"


def odd_container(rng, file, state):
    if file is state:
        return "no container"
    key = rng.choice(["args", "epoch", "step", "history", "model_ema"])
    value = rng.choice([_nested(rng.choice([10, 900]), {}), 10**30, "x" * 1000, [1] * 1000, {"a": {"b": 1}}, 5])
    file[key] = value
    return f"{key} = {type(value).__name__}"


MUTATIONS: list[Callable] = [
    zero_stride,
    crafted_strides,
    special_tensor,
    other_dtype,
    odd_values,
    odd_shape,
    odd_key,
    shared_storage,
    numpy_scalars,
    wrong_args,
    odd_container,
]
TARGETS = ("gridpe", "mope", "wepe", "vit", "export")


def cases(seed: int, count: int, work: Path) -> list[tuple[Case, Any]]:
    """``count`` seeded cases over every target, each with one to three mutations, plus one
    unmutated control per target first."""
    rng = random.Random(seed)
    out = []
    for i in range(count + len(TARGETS)):
        target = TARGETS[i % len(TARGETS)]
        file, state = base_file(target)
        mutations = [] if i < len(TARGETS) else [rng.choice(MUTATIONS)(rng, file, state) for _ in range(rng.randint(1, 3))]
        folder = work / f"case{i:03d}-{target}"
        folder.mkdir(parents=True)
        suffix = ".pt" if target == "mope" else ".pth"
        case = Case(f"case{i:03d}", target, mutations, folder / f"checkpoint{suffix}", folder / "out")
        if target != "export" and i % 2:  # a model directory already there, which a refusal must leave as it was
            case.output.mkdir()
            (case.output / "config.json").write_text('{"written": "before"}')
            (case.output / "model.safetensors").write_bytes(b"weights written before")
        out.append((case, file))
    return out


def _write(case: Case, file: Any) -> str | None:
    """Write the case's file (``None``), or say why torch cannot write it (the case is skipped)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # the pickler recurses once per nesting level
    try:
        torch.save(file, case.file)
    except Exception as err:  # a mutation torch refuses to write (not what the fuzz tests)
        return f"{type(err).__name__}: {str(err)[:120]}"
    finally:
        sys.setrecursionlimit(limit)
    if case.target == "export":
        from deploykit._io import write_json_atomic
        from deploykit.nn import create_model

        write_json_atomic(
            case.file.parent / "config.json", create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=3).cfg.to_dict()
        )
    return None


def _run(argv: list[str]) -> tuple[int | None, str, str | None]:
    """``deploykit ARGV`` in-process: (exit code, stderr, the last line of an escaped exception)."""
    from deploykit.cli import main

    err, escaped, code = io.StringIO(), None, 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as exc:  # what the fuzz looks for
            code, escaped = None, "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1][:300]
    return code, err.getvalue(), escaped


def _contents(folder: Path) -> dict[str, str] | None:
    """``{name: sha256}`` of what ``folder`` holds, or None when it does not exist."""
    import hashlib

    if not folder.is_dir():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _peak() -> int:
    """This process's peak resident size (``VmHWM``; ``ru_maxrss`` would start at the parent's peak,
    kept across fork and exec, and hide a case's growth under pytest's own)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024


def _limit_address_space() -> None:
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + ADDRESS_SPACE_MARGIN, resource.RLIM_INFINITY))


def main(seed: int, count: int, work: Path) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    limited = False
    for index, (case, file) in enumerate(cases(seed, count, work)):
        unwritable = _write(case, file)
        if index == len(TARGETS) and not limited:  # the controls ran: bound what is left
            _limit_address_space()
            limited = True
        record = dict(name=case.name, target=case.target, mutations=case.mutations, argv=case.argv(), control=index < len(TARGETS))
        if unwritable:
            record.update(skipped=unwritable)
        else:
            before = _contents(case.output)
            code, err, escaped = _run(case.argv())
            after = _contents(case.output)
            record.update(code=code, stderr=err[-4000:], stderr_chars=len(err), escaped=escaped, peak=_peak(), before=before, after=after)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))

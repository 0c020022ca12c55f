"""The MoPE repository's own model, checkpoints and logits at a tiny size, recorded for
``tests/nn/test_from_mope.py`` (which reads only what this writes, never the repository).

It builds the official model classes of ``paper2_ega_mope/gpt_phase4_memfix.py`` from a checkout
given on the command line, at a tiny seeded size, saves each model with the script's own
``train_model`` (two steps of its training loop, so the file is what its ``save_ckpt`` writes:
``{"model_state", "optimizer_state", "history", "step"}``), then records the official forward
(eval mode) at every length from 1 to the block size.

The script trains six models at import time (it downloads TinyShakespeare and needs CUDA), so
it is not imported: its top-level function and class definitions are read with ``ast`` and run
in a namespace holding its module globals at the tiny size below. Nothing is copied from it.

Before saving, every parameter is moved off its initial value (seeded noise), as training
moves them, so that a LayerNorm, an EGA slope or a MoPE bandwidth mapped to the wrong place
changes the logits. Some MoPE pairs then sit on each side of the admissibility projection.

Run it where torch, numpy and tqdm import (the script's own imports; not deploykit's venv)::

    python tests/nn/record_mope.py --repo PATH/TO/energy-gated-attention
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
from pathlib import Path

import torch

SCRIPT = "paper2_ega_mope/gpt_phase4_memfix.py"
OUT = Path(__file__).with_name("data") / "mope"
# The script's module globals at a tiny size (its own: VOCAB 65, BLOCK_SIZE 256, N_EMBED 256,
# N_HEAD 8, N_LAYER 6). MAX_ITERS 2 and EVAL_INTERVAL 1 make train_model save after each step.
TINY = dict(
    VOCAB=11,
    BLOCK_SIZE=8,
    N_EMBED=12,
    N_HEAD=3,
    N_LAYER=2,
    DROPOUT=0.1,
    BATCH_SIZE=2,
    LR=3e-4,
    MAX_ITERS=2,
    EVAL_INTERVAL=1,
    N_EVAL_BATCHES=1,
    WARMUP_ITERS=300,
    GRAD_CLIP=1.0,
    DEVICE="cpu",
    USE_AMP=False,
)
# (label, the script's save name, attention class, positional-encoding class or None for its
# learned nn.Embedding table): the Table-2 models whose parts deploykit's sequence model has.
VARIANTS = (
    ("EGA-MORLET", "exp2_egam", "EGA1Attention", "MorletPE"),
    ("PE-MORLET", "exp2_morlet", "DotProductAttention", "MorletPE"),
    ("EGA-1", "exp1_ega1", "EGA1Attention", None),
)
SEED = 42  # the script's torch.manual_seed
BATCH = 2


def official_namespace(repo: Path, checkpoint_dir: Path) -> dict:
    """The script's functions and classes, defined in a namespace that holds its globals."""
    from torch import nn
    from torch.cuda.amp import GradScaler, autocast
    from tqdm.auto import tqdm

    tree = ast.parse((repo / SCRIPT).read_text(), filename=SCRIPT)
    definitions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    namespace = dict(math=math, os=os, torch=torch, nn=nn, F=nn.functional, autocast=autocast, GradScaler=GradScaler, tqdm=tqdm)
    namespace.update(TINY, CKPT_DIR=str(checkpoint_dir))
    # Its dataset: random characters of the tiny vocabulary, split 90/10 as the script does.
    data = torch.randint(TINY["VOCAB"], (400,), generator=torch.Generator().manual_seed(SEED))
    namespace.update(train_data=data[:360], val_data=data[360:])
    exec(compile(ast.Module(definitions, type_ignores=[]), str(repo / SCRIPT), "exec"), namespace)
    return namespace


def moved_off_init(model: torch.nn.Module) -> None:
    """Seeded noise on every parameter (the tied embedding once): what training would do."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name.startswith("pe.") else 0.1
            param.add_(torch.randn_like(param) * scale)


def admissibility_sides(pe: torch.nn.Module) -> tuple[int, int]:
    """How many MoPE pairs the script's projection ``ω ← 5/σ`` moves, and how many it keeps."""
    omega = pe.log_omega.exp().clamp(max=math.pi * 0.95)
    sigma = pe.log_sigma.exp().clamp(min=1e-3)
    moved = int((omega * sigma < 5.0).sum())
    return moved, len(omega) - moved


def record(repo: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    official = official_namespace(repo, out)
    tokens = torch.randint(TINY["VOCAB"], (BATCH, TINY["BLOCK_SIZE"]), generator=torch.Generator().manual_seed(SEED + 1))
    variants = {}
    for label, save_name, attention, encoding in VARIANTS:
        torch.manual_seed(SEED)
        pe_class = official[encoding] if encoding else None
        model = official["GPT"](official[attention], {}, pe_class, label=label)
        moved_off_init(model)
        if pe_class is not None:
            moved, kept = admissibility_sides(model.pe)
            assert moved and kept, f"{label}: the projection should move some pairs and keep others ({moved} moved, {kept} kept)"
        official["train_model"](label, model, save_name)  # saves out/<save_name>.pt as the script does
        model.eval()
        with torch.no_grad():
            logits = {str(t): official_logits(model, tokens[:, :t]) for t in range(1, TINY["BLOCK_SIZE"] + 1)}
        variants[save_name] = dict(label=label, checkpoint=f"{save_name}.pt", attention=attention, encoding=encoding, logits=logits)
    return dict(
        repository="AthanasiosZeris/energy-gated-attention",
        commit=commit_of(repo),
        script=SCRIPT,
        torch=torch.__version__,
        sizes={k: TINY[k] for k in ("VOCAB", "BLOCK_SIZE", "N_EMBED", "N_HEAD", "N_LAYER", "DROPOUT")},
        tokens=tokens.tolist(),
        variants=variants,
    )


def official_logits(model: torch.nn.Module, tokens: torch.Tensor) -> list:
    logits, loss = model(tokens)
    assert loss is None
    return logits.tolist()


def commit_of(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, required=True, help="a checkout of AthanasiosZeris/energy-gated-attention")
    parser.add_argument("--out", type=Path, default=OUT, help=f"fixture directory (default {OUT})")
    args = parser.parse_args()
    reference = record(args.repo, args.out)
    (args.out / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()

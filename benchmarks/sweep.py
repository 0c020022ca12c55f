"""The standard sweep: every registered encoding × resolutions × backends × batch 1 and 8,
ViT-S and ViT-B, with the machine's GEMM roofline. Writes one JSON file per model to
``benchmarks/results/`` and regenerates ``benchmarks/README.md``.

    python benchmarks/sweep.py            # full sweep (long: run it on a quiet machine)
    python benchmarks/sweep.py --quick    # ViT-S, 224/384, short budget, kernel-only

Re-running overwrites the same files, so a later run on a quiet machine replaces these numbers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from deploykit._io import write_json_atomic
from deploykit.encodings import list_encodings
from deploykit.inputs.resolutions import parse_resolution, resolution_tag
from deploykit.nn import create_model
from deploykit.profile import Budget, profile

sys.path.insert(0, str(Path(__file__).parent))
from make_readme import write_readme
from roofline import gemm_roofline

RESULTS = Path(__file__).parent / "results"
FULL = dict(
    models=["vit_small_patch16", "vit_base_patch16"],
    resolutions=["224", "384", "512"],
    batches=[1, 8],
    duration=2.0,
    rounds=2,
    warmup=3,
    min_iterations=5,
    end_to_end=True,
)
QUICK = dict(
    models=["vit_small_patch16"],
    resolutions=["224", "384"],
    batches=[1, 8],
    duration=0.5,
    rounds=1,
    warmup=1,
    min_iterations=3,
    end_to_end=False,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced sweep (see QUICK)")
    parser.add_argument("--models", nargs="+", help="model sizes (default: ViT-S and ViT-B; quick: ViT-S)")
    parser.add_argument("--resolutions", nargs="+", help="default 224 384 512; quick: 224 384")
    parser.add_argument("--batches", nargs="+", type=int, help="default 1 8")
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    parser.add_argument("--backends", nargs="+", default=None, help="default: torch and every registered ONNX runner that works here")
    parser.add_argument("--duration", type=float, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per measurement")
    parser.add_argument("--warmup", type=int, help="untimed calls before each measurement")
    parser.add_argument("--min-iterations", type=int, help="timed calls per measurement even when the duration is spent")
    parser.add_argument("--kernel-only", action="store_true", help="skip the end-to-end timings (halves a long sweep)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the resolutions already in the output file and add the others (e.g. 512 at batch 1 only)",
    )
    parser.add_argument("--device", default="cpu", help="PyTorch device: cpu or cuda")
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. 'shared machine, loaded')")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result file name, for a sweep beside the standard one")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.end_to_end = (QUICK if args.quick else FULL)["end_to_end"] and not args.kernel_only
    return args


def default_backends() -> list[str]:
    """torch, plus every registered runner whose prerequisites are present on this machine."""
    from deploykit.backends.registry import available_backends

    return ["torch", *available_backends()]


def sweep_model(name: str, args, path: Path) -> dict:
    """Profile every encoding of one trunk, one resolution at a time; after each resolution the
    file at ``path`` is rewritten with what is done so far (``"complete": false`` until the end),
    so an interrupted long sweep keeps its finished resolutions."""
    encodings = args.encodings or list_encodings()
    models = []
    for encoding in encodings:
        torch.manual_seed(0)
        models.append(create_model(name, encoding=encoding).eval())
    resolutions = [parse_resolution(r) for r in args.resolutions]
    budget = Budget(duration_s=args.duration, warmup=args.warmup, min_iterations=args.min_iterations, rounds=args.rounds)
    started = time.time()
    data: dict = {}
    if args.resume and path.is_file():
        data = json.loads(path.read_text())
        if data.get("model") != name:
            raise SystemExit(f"--resume: {path} holds {data.get('model')}, not {name}")
        resolutions = [r for r in resolutions if resolution_tag(r) not in data["settings"]["resolutions"]]
        data["command"] += " && python benchmarks/sweep.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        started -= data.get("wall_s", 0)
    for done, resolution in enumerate(resolutions, 1):
        report = profile(
            models,
            resolutions=[resolution],
            batches=args.batches,
            backends=args.backends or default_backends(),
            budget=budget,
            end_to_end=args.end_to_end,
            device=args.device,
            label=name,
            progress=lambda m: print(f"  {time.strftime('%H:%M:%S')} {name}: {m}", file=sys.stderr, flush=True),
        )
        roofline = {}
        for batch in args.batches:
            key = f"{resolution_tag(resolution)}/b{batch}"
            print(f"  {name}: GEMM roofline {key}", file=sys.stderr, flush=True)
            roofline[key] = gemm_roofline(models[0].cfg, resolution, batch)
        part = report.to_json()
        for record in part["records"]:
            peak = roofline[f"{record['resolution']}/b{record['batch']}"]["gflop_per_s"]
            record["roofline_gflop_per_s"] = peak
            record["roofline_fraction"] = record["achieved_gflop_per_s"] / peak
        if not data:
            data = part
            data.update(
                model=name,
                mode="quick" if args.quick else "full",
                note=args.note,
                roofline={},
                command="python benchmarks/sweep.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            )
        else:
            data["records"] += part["records"]
            data["settings"]["resolutions"] += part["settings"]["resolutions"]
            data["settings"]["batches"] = sorted({*data["settings"]["batches"], *part["settings"]["batches"]})
            data["environment"]["load_average_end"] = part["environment"]["load_average_end"]
        data["roofline"].update(roofline)
        data.update(complete=done == len(resolutions), wall_s=round(time.time() - started, 1))
        write_json_atomic(path, data)
        print(f"wrote {path} ({resolution_tag(resolution)} done, {data['wall_s']} s)", file=sys.stderr, flush=True)
    return data


def main(argv=None) -> None:
    args = parse_args(argv)
    device = "cuda" if args.device == "cuda" else "cpu"
    for name in args.models:
        tag = f"-{args.tag}" if args.tag else ""
        sweep_model(name, args, args.output_dir / f"{device}-{'quick' if args.quick else 'full'}-{name}{tag}.json")
    readme = write_readme(args.output_dir, Path(__file__).parent / "README.md")
    print(f"wrote {readme}", file=sys.stderr)


if __name__ == "__main__":
    main()

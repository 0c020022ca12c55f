"""MkDocs hooks: the pages' generated parts, made from the code and the committed results at build time.

A page asks for a part with a marker line, ``<!-- generate: NAME -->``; ``GENERATORS`` maps each
name to the function that writes it. Figures are PNG files added to the build (``on_files``), so
no number or plot in the documentation is copied by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- generate: ([a-z0-9-]+)((?: \S+)*) -->$", re.M)
SWEEP_MODES = ("full", "quick")


def _sweeps() -> list[Path]:
    """Profile sweeps (``benchmarks/sweep.py``): the results files that hold profile records."""
    # <device>-<mode>-<model>.json; the A/B files beside them (more dashes) compare variants in tables only.
    found = [p for p in sorted(RESULTS.glob("*-*-*.json")) if len(p.stem.split("-")) == 3]
    return [p for p in found if json.loads(p.read_text()).get("mode") in SWEEP_MODES]


def _plot_name(path: Path) -> str:
    return f"benchmarks/{path.stem}.png"


def benchmark_results() -> str:
    """``benchmarks/README.md`` with its tables rendered again from the results files, and a
    latency-vs-resolution plot of each profile sweep."""
    from benchmarks.make_readme import BEGIN, END, render

    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    head = head.split("\n", 1)[1]  # the page has its own title
    head, results_heading, _ = head.rpartition("## Results")  # the plots go before the tables' heading
    plots = [f"![{p.stem}]({_plot_name(p)})\n\n_`benchmarks/results/{p.name}`_\n" for p in _sweeps()]
    return "\n".join([head, "## Latency against resolution\n", *plots, f"{results_heading}\n", render(RESULTS), rest.split(END, 1)[1]])


def cpu_backends_table() -> str:
    from benchmarks.make_readme import cpu_backends_table as table

    return "\n".join(table(json.loads((RESULTS / "cpu-backends.json").read_text()))) + "\n"


def precision_plans() -> str:
    from deploykit.export.precision import PLANS

    rows = ["| plan | what it changes | TensorRT builds it |", "|---|---|---|"]
    rows += [f"| `{p.name}` | {p.summary} | {'no: ' + p.ort_only if p.ort_only else 'yes'} |" for p in PLANS.values()]
    return "\n".join(rows) + "\n"


def plan_tolerances() -> str:
    """Each plan's thresholds, the fields a plan sets away from its criterion's defaults."""
    from deploykit.export.precision import PLANS

    rows = ["| plan | passes when |", "|---|---|"]
    for plan in PLANS.values():
        tolerance = plan.tolerance
        defaults = {f.name: f.default for f in dataclasses.fields(tolerance)}
        shown = {name: value for name, value in dataclasses.asdict(tolerance).items() if value not in (None, defaults[name])}
        rows.append(f"| `{plan.name}` | {', '.join(f'`{name}` {value}' for name, value in shown.items())} |")
    return "\n".join(rows) + "\n"


def results(name: str, path: str = "records", columns: str = "") -> str:
    """A table of one committed results file (``benchmarks/make_readme.py``'s ``results_table``)."""
    from benchmarks.make_readme import results_table

    return "\n".join(results_table(RESULTS, name, path, columns)) + "\n"


def benchmark_table(name: str) -> str:
    """The table ``benchmarks/README.md`` shows for results file ``name`` (``make_readme.TABLES``)."""
    from benchmarks.make_readme import TABLES, results_table

    path, columns = next((path, columns) for _, file, path, columns in TABLES if file == name)
    return "\n".join(results_table(RESULTS, name, path, columns)) + "\n"


def int8_attention() -> str:
    """Top-1 agreement with fp32 of each zoo model's int8 plan at each resolution, with the attention
    products float (what deploykit writes) and int8 (``int8_plans.py attention``)."""
    records = json.loads((RESULTS / "int8-attention.json").read_text())["records"]
    by = {(r["model"], r["resolution"], r["attention_int8"]): r["agreement"] for r in records}
    rows = ["| model | resolution | attention float | attention int8 |", "|---|---|---|---|"]
    rows += [f"| {m} | {res} | {by[m, res, False]:.2%} | {by[m, res, True]:.2%} |" for m, res, int8 in by if not int8]
    return "\n".join([*rows, "", "_From `benchmarks/results/int8-attention.json`._", ""])


def plan_agreement(name: str) -> str:
    """Each CPU lane's lowest top-1 agreement with PyTorch fp32 over the zoo (``cpu_plan_accuracy.py``),
    the cell where it was lowest, and its median over the cells."""
    data = json.loads((RESULTS / name).read_text())
    rows = ["| lane | lowest agreement | where | median over the cells |", "|---|---|---|---|"]
    for lane in dict.fromkeys(r["lane"] for r in data["records"]):
        cells = sorted(
            (r["agreement"], f"{r['model']} at {r['scale']:g}× its training resolution") for r in data["records"] if r["lane"] == lane
        )
        rows.append(f"| {lane} | {cells[0][0]:.2%} | {cells[0][1]} | {cells[len(cells) // 2][0]:.2%} |")
    return "\n".join([*rows, "", f"_From `benchmarks/results/{name}`._", ""])


def int8_speed() -> str:
    """Each ``int8_plans.py speed`` file's plans as ratios to the fp32 graph's p50: the range over
    its cells, and how many cells are at or below half."""
    rows = ["| results file | plan | p50 ÷ fp32 p50 | cells at or below 0.5 |", "|---|---|---|---|"]
    for path in sorted(RESULTS.glob("int8-speed-*.json")):
        records = json.loads(path.read_text())["records"]
        for plan in dict.fromkeys(r["variant"] for r in records if r["variant"] != "fp32"):
            ratios = sorted(r["ratio_vs_fp32"] for r in records if r["variant"] == plan)
            half = sum(ratio <= 0.5 for ratio in ratios)
            rows.append(f"| `{path.name}` | `{plan}` | {ratios[0]:.2f}-{ratios[-1]:.2f} | {half} of {len(ratios)} |")
    return "\n".join(rows) + "\n"


def serving() -> str:
    """``serve_cpu.py``'s goals and levels (served against in-process, OpenVINO against
    benchmark_app) and ``serve_overhead.py``'s layers of one request, with their machine line."""
    cpu = json.loads((RESULTS / "serve_cpu.json").read_text())
    rows = ["| goal | measured (median of fresh servers) | each server | met |", "|---|---|---|---|"]
    for g in cpu["goals"]:
        runs = ", ".join(f"{r:.2f}" for r in g.get("runs", ())) if len(g.get("runs", ())) > 1 else ""
        rows.append(f"| {g['name']} | {g['ratio']:.2f} | {runs} | {'yes' if g['met'] else 'no'} |")
    rows += ["", "The first server's levels, open-loop rates included:", ""]
    rows += ["| load | in process | served | served ÷ in process | served p50 ms | in-process p50 ms |", "|---|---|---|---|---|---|"]
    for level in cpu["levels"]:
        load = f"concurrency {level['concurrency']}" if "concurrency" in level else f"{level['rate_rps']:g} requests/s"
        inside, served = level["in_process"], level["served"]
        rows.append(
            f"| {load} | {inside['throughput_rps']:.1f}/s | {served['throughput_rps']:.1f}/s | "
            f"{level['served_vs_in_process_throughput']:.2f} | {served['p50_ms']:.1f} | {inside['p50_ms']:.1f} |"
        )
    overhead = json.loads((RESULTS / "serve_overhead.json").read_text())
    rows += ["", "| layer of one request at concurrency 1 | ms |", "|---|---|"]
    rows += [f"| {name} | {ms:.2f} |" for name, ms in overhead["layers_ms"].items()]
    rows += [
        "",
        f"_From `benchmarks/results/serve_cpu.json` ({cpu['model']}; {cpu['environment_line']}) and "
        f"`benchmarks/results/serve_overhead.json` ({overhead['model']})._",
        "",
    ]
    return "\n".join(rows)


def examples() -> str:
    """One section per script in ``examples/``: its header docstring and how to run it."""
    parts = []
    for script in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        title, _, body = doc.partition("\n")
        parts += [f"## `{script.name}`: {title}", "", body.strip(), "", f"```text\npython examples/{script.name} --help\n```", ""]
    return "\n".join(parts)


def tests(relative: str) -> str:
    """One line per test of ``tests/<relative>``: its name as a sentence and its docstring's first line."""
    path = ROOT / "tests" / relative
    lines = [f"From `tests/{relative}`:", ""]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
            lines.append(f"- {node.name.removeprefix('test_').replace('_', ' ')}" + (f": {doc}" if doc else ""))
    return "\n".join(lines) + "\n"


GENERATORS = {
    "benchmark-results": benchmark_results,
    "cpu-backends-table": cpu_backends_table,
    "precision-plans": precision_plans,
    "plan-tolerances": plan_tolerances,
    "results": results,
    "int8-attention": int8_attention,
    "benchmark-table": benchmark_table,
    "int8-speed": int8_speed,
    "plan-agreement": plan_agreement,
    "serving": serving,
    "examples": examples,
    "tests": tests,
}


def on_config(config):
    # benchmarks/ and deploykit/ of this checkout (MkDocs restores sys.path after loading a hook).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files, config):
    """Add each sweep's plot, drawn from its results file, to the build."""
    from deploykit.profile.output import plot_latency
    from deploykit.profile.report import ProfileRecord

    with tempfile.TemporaryDirectory() as work:
        for path in _sweeps():
            records = [ProfileRecord.from_dict(r) for r in json.loads(path.read_text())["records"]]
            png = plot_latency(Path(work) / f"{path.stem}.png", records, title=path.stem)
            files.append(File.generated(config, _plot_name(path), content=png.read_bytes()))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = MARKER.sub(lambda match: GENERATORS[match.group(1)](*match.group(2).split()), markdown)
    if "<!-- generate:" in markdown:  # a marker the pattern missed would leave its part out silently
        raise ValueError(f"{page.file.src_path}: a '<!-- generate: ' marker that is not one line of a known NAME")
    return markdown

"""The README and the documentation site stay true: the site builds with ``--strict`` (no broken
link, missing page or API reference that no longer resolves), every code block runs or says why
not, and every ``deploykit`` command written anywhere in them parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:^<!-- not run: (?P<reason>.+?) -->\n)?^```(?P<lang>bash|python)\n(?P<code>.*?)^```$", re.M | re.S)
# What the quick start's shell block shortens: profile's timings (the commands are the README's, the budget a test's).
SHORT_PROFILE = ["--duration", "0.05", "--warmup", "1", "--rounds", "1", "--no-end-to-end"]


def _blocks(lang: str) -> list[tuple[str, str, str | None]]:
    """``(page:line, code, reason it is not run or None)`` of every ``lang`` block."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match["lang"] == lang:
                where = f"{page.relative_to(ROOT)}:{text[: match.start('code')].count(chr(10)) + 1}"
                found.append((where, match["code"], match["reason"]))
    return found


def _deploykit_commands(code: str) -> list[list[str]]:
    """The argument lists of every ``deploykit`` call in a shell block (``a && deploykit b`` included)."""
    commands = []
    for line in code.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and Path(words[0]).name == "deploykit":
                commands.append(words[1:])
    return commands


def _parse(args: list[str]) -> None:
    """Parse a command line as ``deploykit`` would, down to its subcommand, without running it."""
    from deploykit.cli import cli

    command, name, parent = cli, "deploykit", None
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, click.Group):
            return
        name, command, args = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        parent = ctx


SHELL = [pytest.param(code, id=where) for where, code, _ in _blocks("bash")]


@pytest.mark.parametrize("code", SHELL)
def test_every_deploykit_command_in_the_docs_parses(code):
    for args in _deploykit_commands(code):
        try:
            _parse(args)
        except click.ClickException as err:
            pytest.fail(f"deploykit {shlex.join(args)}: {err.format_message()}")


def test_every_shell_block_runs_or_says_why_not():
    unmarked = [where for where, _, reason in _blocks("bash") if reason is None]
    assert unmarked == [], "mark each with <!-- not run: REASON --> or make it run on a tiny model"


@pytest.mark.slow
@pytest.mark.parametrize("where, code", [pytest.param(w, c, id=w) for w, c, reason in _blocks("python") if reason is None])
def test_python_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


@pytest.mark.slow
def test_the_readme_quick_start_runs_up_to_serving(tmp_path, monkeypatch, deploykit_cli):
    """The README's shell quick start on the zoo's default model, every line but ``serve`` (it runs until stopped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(m["code"] for m in FENCE.finditer(text) if "deploykit serve" in m["code"])
    commands = [args for args in _deploykit_commands(block) if args[0] != "serve"]
    assert [args[0] for args in commands] == ["export", "validate", "profile"]
    monkeypatch.chdir(tmp_path)
    for args in commands:
        code, err = deploykit_cli(*args, *(SHORT_PROFILE if args[0] == "profile" else []))
        assert code == 0, (args, err)
    assert (tmp_path / "out" / "default" / "profile_choice.json").is_file()


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: every warning (a broken link, a page not in nav, a docstring
    reference that no longer resolves, a generated table whose results file is gone) fails."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)
    site = tmp_path / "site"
    assert (site / "reference" / "cli" / "index.html").read_text().count("deploykit validate") > 0
    plots = sorted(p.name for p in (site / "benchmarks").glob("*.png"))  # drawn from the results files
    assert plots and all(name in (site / "benchmarks" / "index.html").read_text() for name in plots)


def _named_in_the_docs(pattern: str) -> set[tuple[str, str]]:
    return {(str(page.relative_to(ROOT)), name) for page in PAGES for name in re.findall(pattern, page.read_text(encoding="utf-8"))}


def test_every_file_the_docs_name_exists():
    """A moved or renamed module, script or results file shows up here, not as a dead pointer."""
    named = _named_in_the_docs(r"`((?:deploykit|benchmarks|tests|plugins|examples|models)/[\w./-]*\w)(?=[`\s:)])")
    missing = [(page, path) for page, path in named if not (ROOT / path).exists() and not path.startswith("deploykit/plugins")]
    assert sorted(missing) == []


def test_every_python_name_the_docs_give_resolves():
    """``deploykit.x.y`` in the text is importable (a metadata key such as ``deploykit.quantization``,
    whose first part is no module of the package, is not a Python name)."""
    import pkgutil

    import deploykit

    modules = {info.name for info in pkgutil.iter_modules(deploykit.__path__)} | set(deploykit.__all__)
    unresolved = []
    for page, name in _named_in_the_docs(r"\b(deploykit(?:\.[A-Za-z_]\w*)+)"):
        if name.split(".")[1] in modules:
            try:
                pkgutil.resolve_name(name)
            except (ImportError, AttributeError) as err:
                unresolved.append((page, name, str(err)))
    assert sorted(unresolved) == []


# A measured figure: a number with a unit of time, rate, ratio, share or size. Figures belong in the
# generated parts (``<!-- generate: results FILE ... -->``, benchmarks/README.md's generated block),
# where they come from a committed results file; the text around them says what they show.
# A ratio is a number with x or × attached ("1.27×", "0.29x") or a decimal before a spaced "×"
# ("0.97 × fp32"); "224 × batch 8" is a product of settings. A figure after ≤ or ≥ is a goal.
FIGURE = re.compile(
    r"(?<![\w.^≤≥-])(?<![≤≥] )\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?"
    r"(?:\s?(?:ms|µs|us|ns|s|sec|seconds|min|minutes|%|GFLOP/s|GB/s|MB/s|images/s|img/s|req/s|rps|KiB|MiB|GiB|KB|MB|GB)"
    r"|[x×]|(?<=\.\d)\s[x×]|(?<=\.\d\d)\s[x×]|(?<=\.\d\d\d)\s[x×])(?![\w/-])"
)
# Figures that are constants of the design, not measurements: each phrase with why it is one.
DESIGN_CONSTANTS = {
    "within 15 minutes": "the suite's budget on CI, a goal",
    "than 48 KiB of shared memory": "CUDA's limit on a kernel's shared memory without the opt-in",
    "above 48 KiB of shared memory": "the same limit",
    "(`export: exporting 224  (3 s)`)": "the format of a progress line",
    "1×, 1.5× and 2×": "the zoo's evaluation resolutions",
    "1.5× and 2×": "the zoo's evaluation resolutions: multiples of the training resolution",
    "at 2× the training resolution": "the resolution an accuracy check runs at",
    "32 MiB encoded": "`ImageLimits`' default",
    "64 KiB of stray bytes": "`imaging.check_structure`'s bound",
    "(64 MiB)": "`--max-request-bytes`' default",
    "10 s after it began": "the front's header timeout",
    "within 60 s": "the front's body timeout",
    "(30 s)": "`--drain-timeout`'s default",
    "400 KB of": "the size of the request that crashes Triton 2.51, a known input",
    "99.5% top-1 agreement": "the int8 plan's default target (`--min-agreement`)",
    ">= 99.50%": "the same target, in a sample of export's output",
    "so that 99% holds": "what that target is chosen for",
}
GENERATED = re.compile(
    r"^<!-- generate: .* -->$|^<!-- generated by benchmarks/make_readme.py: begin -->$.*?^<!-- generated by benchmarks/make_readme.py: end -->$",
    re.M | re.S,
)


def _hand_written_figures(text: str) -> list[str]:
    """The measured figures in a page's hand-written text: outside its generated parts, the design constants taken out."""
    text = GENERATED.sub("", text)
    for phrase in DESIGN_CONSTANTS:
        text = text.replace(phrase, "")
    return [match[0] for match in FIGURE.finditer(text)]


FIGURE_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]


def test_no_hand_written_figure():
    """Every latency, ratio, rate, share or measured size in the README, the docs and benchmarks/README.md
    is generated from a committed results file, so none goes stale or is copied wrong."""
    found = {str(page.relative_to(ROOT)): _hand_written_figures(page.read_text(encoding="utf-8")) for page in FIGURE_PAGES}
    assert {page: figures for page, figures in found.items() if figures} == {}


def test_every_design_constant_allowed_is_one_the_pages_use():
    """The allow-list stays short: each phrase holds a figure the test would otherwise flag, in a page that has it."""
    texts = [page.read_text(encoding="utf-8") for page in FIGURE_PAGES]
    assert [phrase for phrase in DESIGN_CONSTANTS if not FIGURE.search(phrase) or not any(phrase in text for text in texts)] == []


@pytest.mark.parametrize("text", ["goal: ≤ 0.85 × torch eager", "≥ 90% of the roofline", "224/384 × batch 1, 8", "ViT-B/16 at 2304 tokens"])
def test_goals_and_settings_are_not_figures(text):
    assert _hand_written_figures(text) == []


@pytest.mark.parametrize(
    "planted", ["took 23.7 ms here", "0.40× ORT fp32", "1.27x faster", "99.3% agreement", "114.8 req/s", "400 MiB more"]
)
def test_a_hand_written_figure_is_caught(planted):
    """The control: a figure planted in hand-written text is found, and the same figure in a generated part is not."""
    assert _hand_written_figures(f"Some prose, {planted}, more prose.\n")
    block = f"<!-- generated by benchmarks/make_readme.py: begin -->\n| {planted} |\n<!-- generated by benchmarks/make_readme.py: end -->\n"
    assert _hand_written_figures(f"Prose.\n{block}<!-- generate: results x.json -->\n") == []

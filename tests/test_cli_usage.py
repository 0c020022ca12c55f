"""One command-line grammar for every command (issue 23): a command line click cannot parse is one
``error:`` line and exit 2, whichever command it is; ``-q``/``-v`` go before or after the
command's name; every repeatable ``-r`` takes comma lists.

Usage errors are found while parsing, before any command runs, so most cases here name paths
that do not exist and cost nothing.
"""

from __future__ import annotations

import json

import click
import pytest

from deploykit.cli import cli
from deploykit.cli.options import Resolutions
from tests.test_cli import RES, assert_usage_error, run_cli


def _commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    """Every command of the CLI tree as ``(path, command)``, groups included."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


COMMANDS = [path for path, _ in _commands()]


@pytest.mark.parametrize(
    "args, needles",
    [
        (["no-such-command"], ("No such command 'no-such-command'",)),
        (["export", "--no-such-option"], ("No such option '--no-such-option'",)),
        (["export", "-r", "32"], ("Missing option '--output'",)),
        (["validate"], ("Missing argument 'EXPORT_DIR'",)),
        (["validate", "missing", "--num-real", "many"], ("--num-real", "'many' is not a valid integer")),
        (["profile", "missing", "--iterations", "0"], ("--iterations", "0 is not in the range")),
        (["profile", "missing", "-r", "32,3x3x3"], ("--resolution", "'3x3x3'")),
        (["build", "missing", "--opt-level", "9"], ("--opt-level",)),
        (["zoo", "eval", "--limit", "0"], ("--limit",)),
        (["package", "triton", "missing"], ("Missing option '--output'",)),
        (["export", "-o", "out", "--calibration-method", "median"], ("--calibration-method", "'median' is not one of")),
    ],
)
def test_a_command_line_that_does_not_parse_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *args)
    assert_usage_error(code, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_deploykit_alone_prints_its_help(capsys):
    code, out, err = run_cli(capsys)
    assert code == 2 and "Commands:" in out + err and "error:" not in err


@pytest.mark.parametrize("flag", ["-q", "-vv"])
@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_takes_q_and_v_after_its_name(capsys, path, flag):
    code, out, err = run_cli(capsys, *path, flag, "--help")
    assert code == 0 and "Usage:" in out and "error" not in err, err


def test_q_after_the_command_is_results_only(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export, "--num-random", "1", "--num-real", "1", "-q")
    assert code == 0 and not [line for line in err.splitlines() if line.startswith("validate: ")], err
    assert "1/1 checks passed" in err.splitlines()


@pytest.mark.slow
def test_v_after_the_command_shows_info_logs(capsys, ckpt_dir, tmp_path):
    """A re-export of the same weights says, at info level, which graphs it keeps."""
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "-q", "export", "-c", ckpt_dir, "-r", RES, "-o", out)
    assert code == 0, err
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "48", "-o", out, "-v")
    assert code == 0 and f"info: keeping model_{RES}.onnx of the previous export (same weights)" in err.splitlines(), err
    code, _, err = run_cli(capsys, "-v", "export", "-c", ckpt_dir, "-r", "64", "-o", out, "-q")  # the last one given wins
    assert code == 0 and [line.split("  (")[0] for line in err.splitlines()] == [f"✓ {out / f'model_{r}.onnx'}" for r in (RES, 48, 64)], err


@pytest.mark.parametrize("path", [p for p, c in _commands() if any("-r" in o.opts and o.multiple for o in c.params)], ids=" ".join)
def test_every_repeatable_r_takes_comma_lists(path):
    command = cli
    for name in path:
        command = command.commands[name]
    (option,) = [o for o in command.params if "-r" in o.opts]
    assert isinstance(option.type, Resolutions), f"deploykit {' '.join(path)} -r does not take comma lists"


def test_the_commands_with_a_repeatable_r():
    """Control for the test above: it covers the commands the README says take ``-r`` lists."""
    with_r = {" ".join(p) for p, c in _commands() if any("-r" in o.opts and o.multiple for o in c.params)}
    assert {"export", "validate", "build", "profile"} <= with_r, with_r


@pytest.mark.slow
def test_export_r_takes_a_comma_list(capsys, ckpt_dir, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "-q", "export", "-c", ckpt_dir, "-r", f"{RES},48", "-r", "48x64", "-o", out)
    assert code == 0, err
    resolutions = [g["resolution"] for g in json.loads((out / "manifest.json").read_text())["graphs"]]
    assert resolutions == [[RES, RES], [48, 48], [48, 64]]

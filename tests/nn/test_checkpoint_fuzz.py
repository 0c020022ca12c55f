"""The done-when's checkpoint fuzz (issue 52): files built from allowed globals only, for every
command that reads a checkpoint (``import gridpe|mope|wepe|vit``, ``export --checkpoint``), each
answered with success or one ``error:`` line, within a stated memory bound, and nothing written
on a refusal. ``checkpoint_fuzz.py`` builds and runs the cases in a child process (its peak
resident size is then the cases' own); this test judges what it reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_fuzz import PEAK_GROWTH_BOUND, TARGETS

FUZZ = Path(__file__).with_name("checkpoint_fuzz.py")
SEED, CASES = 52, 32
# The longest error line a refusal may print: it names a key, a shape, a file; never the file's contents.
MAX_ERROR_CHARS = 1000


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("fuzz")
    run = subprocess.run([sys.executable, str(FUZZ), str(SEED), str(CASES), str(work)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_every_case_ran_and_the_controls_import(fuzzed):
    assert len(fuzzed) == CASES + len(TARGETS)
    controls = [r for r in fuzzed if r["control"]]
    assert [(r["target"], r["code"]) for r in controls] == [(t, 0) for t in TARGETS], [r["stderr"] for r in controls]
    ran = [r for r in fuzzed if not r["control"] and "skipped" not in r]
    assert len(ran) >= CASES * 3 // 4  # a mutation torch cannot write is skipped, and only that
    assert {r["target"] for r in ran} == set(TARGETS)
    assert sum(r["code"] != 0 for r in ran) >= len(ran) // 2  # the mutations reach the checks


def test_no_case_escapes_as_a_traceback_and_every_refusal_is_one_short_error_line(fuzzed):
    for record in (r for r in fuzzed if "skipped" not in r):
        what = f"{record['name']} {record['target']} {record['mutations']}"
        assert record["escaped"] is None, f"{what}: {record['escaped']}"
        if record["code"]:
            lines = record["stderr"].splitlines()
            assert record["code"] == 1 and lines and lines[-1].startswith("error: "), f"{what}: {record['stderr'][-500:]}"
            assert sum(line.startswith("error") for line in lines) == 1 and "Traceback" not in record["stderr"], what
            assert len(lines[-1]) <= MAX_ERROR_CHARS and record["stderr_chars"] <= 4000, f"{what}: {len(lines[-1]):,} characters"


def test_no_case_grows_the_process_beyond_the_bound(fuzzed):
    controls = max(r["peak"] for r in fuzzed if r["control"])
    for record in (r for r in fuzzed if "skipped" not in r):
        grown = record["peak"] - controls
        assert grown <= PEAK_GROWTH_BOUND, f"{record['name']} {record['target']} {record['mutations']}: peak grew {grown >> 20} MiB"


def test_a_refusal_writes_nothing_and_leaves_what_was_there(fuzzed):
    refused = [r for r in fuzzed if "skipped" not in r and r["code"]]
    assert any(r["before"] for r in refused)  # some refusals had a model directory to keep
    for record in refused:
        assert record["after"] == record["before"], f"{record['name']} {record['mutations']}: {record['before']} -> {record['after']}"

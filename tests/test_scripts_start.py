"""Every Python script in scripts/ starts: ``--help`` prints its usage and exits 0.

The scripts are run by hand and by nothing else in the suite, so a module
they import that moves or is renamed would break them silently; this runs
each one as a user would, from the repository's root, with the project's
interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def python_scripts() -> list[str]:
    found = []
    for name in sorted(os.listdir(SCRIPTS)):
        path = os.path.join(SCRIPTS, name)
        if name.startswith("_") or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and b"python" in first:
            found.append(name)
    return found


def test_the_scripts_are_found():
    assert {"bench_vs_rabbitmq", "raw_driver.py", "recovery_time"} <= set(python_scripts())


@pytest.mark.parametrize("name", python_scripts())
def test_a_script_answers_help_with_its_usage(name):
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name}"), done.stdout[:200]


def test_parse_cost_reports_each_way_and_refuses_a_cut_outside_the_message():
    run = [sys.executable, os.path.join(SCRIPTS, "parse_cost"), "--size", "20000", "-n", "50", "--repeats", "1"]
    done = subprocess.run(run + ["--cut", "100"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("20,000 B bodies, 20,048 B a message, 50 messages")
    assert [line.split("  ")[1].strip() for line in lines[1:]] == ["whole, one read", "cut after 100 B, two reads"]
    bad = subprocess.run(run + ["--cut", "20048"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cut must be 1-20047" in bad.stderr

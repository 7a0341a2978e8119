"""The import rules of STYLE.md: ipc uses only the standard library and posix_ipc; alarms adds ipc and psutil
(psutil in one module); only pipeline.analytics imports pyspark, and no broker process loads it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_ipc_uses_only_the_standard_library_and_posix_ipc():
    for path in modules("ipc"):
        extra = imports(path) - STDLIB - {"posix_ipc", "ipc", "__future__"}
        assert not extra, f"{path.name} imports {extra}"


def test_alarms_uses_ipc_and_psutil_in_exactly_one_module():
    users = []
    for path in modules("alarms"):
        found = imports(path)
        extra = found - STDLIB - {"ipc", "alarms", "psutil", "__future__"}
        assert not extra, f"{path.name} imports {extra}"
        if "psutil" in found:
            users.append(path.name)
    assert users == ["probes.py"]


def test_only_analytics_imports_pyspark():
    for package in ("ipc", "alarms", "pipeline"):
        for path in modules(package):
            if "analytics" in path.parts:
                continue
            assert "pyspark" not in imports(path), f"{path} imports pyspark"


def test_a_broker_does_not_load_pyspark():
    code = ("import sys, pipeline.broker.supervisor, pipeline.broker.reader, pipeline.broker.channel, pipeline.broker.queue, pipeline.broker.store, "
            "alarms.watchdog; print(any(m.startswith('pyspark') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_broker_never_imports_the_tools_on_top_of_it():
    """LAYOUT.md: the commands (CLI, bench, demo, view, sweeps), the load generator, the stress scripts and
    the Spark analytics sit on top; nothing that runs inside the broker's processes imports them."""
    tools = {"cli", "runner", "bench", "demo", "view", "sweep", "machine", "venv", "loadgen", "stress", "analytics"}
    for package in ("pipeline/broker", "pipeline/storage", "pipeline/amqp", "pipeline/telemetry",
                    "pipeline/management"):
        for path in modules(package):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                if isinstance(node, ast.ImportFrom) and node.module == "pipeline":
                    names = [f"pipeline.{a.name}" for a in node.names]
                for name in names:
                    parts = name.split(".")
                    assert not (parts[0] == "pipeline" and len(parts) > 1 and parts[1] in tools), \
                        f"{path.relative_to(ROOT)} imports {name}"

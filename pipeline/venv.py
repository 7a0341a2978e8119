"""Scripts run with any Python re-run themselves with the project's own (``.venv``, made by ./scripts/test)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_project_venv() -> None:
    """Exec the calling script under ``.venv/bin/python`` unless already there (or no .venv exists)."""
    venv = ROOT / ".venv"
    python = venv / "bin" / "python"
    if not python.exists() or Path(sys.prefix).resolve() == venv.resolve():
        return
    os.execv(str(python), [str(python), os.path.abspath(sys.argv[0]), *sys.argv[1:]])

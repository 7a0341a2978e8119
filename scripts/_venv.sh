# Sourced by scripts/demo and scripts/test: make sure .venv exists and holds
# the project with its test extras, reinstalling only when pyproject.toml changes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
    # $PYTHON if set; else the fastest Python 3.11 here that can build it (scripts/_pick_python.py)
    py="${PYTHON:-}"
    if [ -z "$py" ]; then
        py="$(python3 scripts/_pick_python.py "$(command -v python3.11 || true)" /usr/bin/python3.11 \
              /usr/local/bin/python3.11 "$(command -v python3 || true)")" || py=python3
    fi
    "$py" -m venv .venv
fi
stamp=.venv/.creditflow-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[test]"
    echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
.venv/bin/python -c 'import sys; print(f"python: {sys._base_executable} {sys.version.split()[0]}", file=sys.stderr)'

#!/usr/bin/env bash
# Creates benchmarks/peers/shardcast/venv with the reference SHARDCAST package (PyPI shardcast 0.3.2),
# isolated from the project venv, for benchmarks/peers/shardcast/peer.py.
# The package shells out to wget for every download (and tries apt/sudo to install it if missing), so
# wget must already be on PATH.
# Idempotent: re-running with a working venv is a no-op.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/venv"
PY="${PYTHON:-python3}"
VERSION="0.3.2"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import sys, importlib.metadata as m, shardcast; sys.exit(0 if m.version('shardcast') == '$VERSION' else 1)" 2>/dev/null; then
  echo "shardcast venv ready: $VENV"; exit 0
fi
command -v wget >/dev/null || { echo "wget is needed by shardcast (apt-get install wget)" >&2; exit 1; }

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "shardcast==$VERSION"
"$VENV/bin/python" -c 'import importlib.metadata as m, shardcast; print("shardcast", m.version("shardcast"), shardcast.__file__)'

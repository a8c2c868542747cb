#!/usr/bin/env bash
# Creates benchmarks/peers/toploc/venv with the reference TOPLOC package (PyPI toploc 0.1.6), isolated
# from the project venv, for benchmarks/toploc_compat.py and benchmarks/toploc_speed.py.
# Its wheel was built against an older torch and does not import on torch 2.13 (undefined symbol), so
# it is rebuilt from the sdist against the local CPU torch 2.13.0 (about 7 minutes, needs g++).
# Idempotent: re-running with a working venv is a no-op.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/venv"
PY="${PYTHON:-python3}"
VERSION="0.1.6"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import toploc, torch, sys; from toploc import build_proofs_bytes; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "toploc venv ready: $VENV"; exit 0
fi
command -v g++ >/dev/null || { echo "g++ is needed to build toploc from source (apt-get install g++)" >&2; exit 1; }

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"  # pinned first: an unpinned resolve picks a multi-GB CUDA build
"${PIP[@]}" numpy wheel ninja setuptools
BUILT="$(mktemp -d)"; trap 'rm -rf "$BUILT"' EXIT
"$VENV/bin/pip" wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  --no-binary toploc "toploc==$VERSION" -w "$BUILT"
"${PIP[@]}" --force-reinstall --no-deps "$BUILT"/toploc-"$VERSION"-*.whl
"$VENV/bin/python" -c 'import toploc, torch; from toploc import build_proofs_bytes; print("toploc", toploc.__file__, "torch", torch.__version__)'

#!/usr/bin/env bash
# Creates benchmarks/peers/hivemind/venv with hivemind 1.1.12, isolated from the
# project venv (hivemind drags in protobuf/grpc/p2pd pins we do not want there).
# Idempotent: re-running with a working venv is a no-op.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/venv"
PY="${PYTHON:-python3}"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import hivemind, numpy, sys; sys.exit(0 if hivemind.__version__ == "1.1.12" and tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 4) else 1)' 2>/dev/null; then
  echo "hivemind venv ready: $VENV"; exit 0
fi

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
# Pin torch exactly: an unpinned resolve picks a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "hivemind==1.1.12" "torch==2.13.0"
# hivemind 1.1.12 extract() breaks on numpy>=2.4 (int(np.frombuffer(..., count=1))); fixed only upstream in 1.2.0.dev0.
"${PIP[@]}" "numpy<2.4" "torch==2.13.0"
"$VENV/bin/python" -c 'import hivemind, numpy, torch; print("hivemind", hivemind.__version__, "numpy", numpy.__version__, "torch", torch.__version__)'

#!/usr/bin/env bash
# Creates benchmarks/peers/trl/venv with TRL, isolated from the project venv, so the
# GRPO loss parity benchmark can run TRL's own GRPOTrainer._compute_loss.
# Idempotent: re-running with a working venv is a no-op.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/venv"
PY="${PYTHON:-python3}"
TRL_VERSION="1.16.0"  # newest on PyPI at writing; GRPOConfig has delta (INTELLECT-2 two-sided clip)

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import sys, trl, torch; sys.exit(0 if trl.__version__ == '$TRL_VERSION' and torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  echo "trl venv ready: $VENV"; exit 0
fi

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
# Torch first and pinned exactly: an unpinned resolve picks a multi-GB CUDA build; 2.13.0 is the local CPU wheel.
CONSTRAINTS="$(mktemp)"; trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -c "$CONSTRAINTS" "trl==$TRL_VERSION" accelerate datasets transformers
"$VENV/bin/python" -c 'import trl, transformers, accelerate, torch; print("trl", trl.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "torch", torch.__version__)'

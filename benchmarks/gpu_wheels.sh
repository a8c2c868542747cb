#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu_wheels.txt (CPython 3.12, manylinux x86_64) into .whl/, which
# git ignores, for a device call that runs benchmarks/gpu_check.sh on the lent GPU machine (no network
# there): carry [".whl"]. Old wheels in the folder are removed first: two versions of one package stop
# the install there. Prints the wheels' size and what a call would carry, against its 64 MiB.
#   bash benchmarks/gpu_wheels.sh [FOLDER]      (default .whl; PYTHON picks the pip, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-python3}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" -r benchmarks/gpu_wheels.txt
wheels=$(cat "$DEST"/*.whl | wc -c)
# what travels besides: tracked files and untracked ones git does not ignore
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
limit=$((64 * 1024 * 1024))
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((wheels / 1024)) KiB in $DEST;" \
     "with the working tree ($((tree / 1024)) KiB) a call carries $(((wheels + tree) / 1024)) KiB of $((limit / 1024))"
if ((wheels + tree > limit)); then
  echo "gpu_wheels: over the 64 MiB a device call carries" >&2
  exit 1
fi

#!/usr/bin/env bash
# One run of every GPU check, for a session lent a CUDA machine (~5 min):
#   the CUDA tests (the Triton kernels compiled, the pool's staged moves), then `python -m bench.gpu`.
# Everything it produces goes under $OUT (default bench/results/gpu-check): tests.log, bench.log,
# gpu.json / gpu.md / gpu.png, env.txt. Uses the machine's own torch (a CUDA build) through a venv
# that sees the system packages; installs triton and the test tools only if they are missing (the
# machine may have no network: then it says so and runs what it can).
#
#   bash bench/gpu_check.sh            # or: OUT=/some/dir PY=python3 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-check}
PY=${PY:-python3}
VENV=${VENV:-${TMPDIR:-/tmp}/pagedkv-gpu-venv}
mkdir -p "$OUT"

{
  date -u
  nvidia-smi || echo "nvidia-smi: not found"
  "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' \
    || echo "no torch for $PY"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV" || { echo "cannot create $VENV"; exit 1; }
fi
V="$VENV/bin/python"
"$V" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "torch in $VENV sees no CUDA device: nothing to check" | tee -a "$OUT/env.txt"; exit 2; }
# The package itself, editable and without touching the dependencies (torch stays the machine's).
"$V" -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 \
  || echo "pip install -e . failed (see env.txt)"
if ! "$V" -c 'import pagedkv.cache_node.attention' 2>/dev/null; then
  # No install (no setuptools offline): the same package layout from symlinks (pyproject's package-dir).
  farm=$(mktemp -d)/pagedkv
  mkdir -p "$farm"
  for f in pagedkv/*; do ln -s "$PWD/$f" "$farm/"; done
  for role in protos cache_node client coordinator; do ln -s "$PWD/$role" "$farm/$role"; done
  export PYTHONPATH="$(dirname "$farm")${PYTHONPATH:+:$PYTHONPATH}"
  echo "pagedkv from symlinks under $(dirname "$farm")" | tee -a "$OUT/env.txt"
fi
for mod in triton pytest pytest_timeout numpy grpc google.protobuf redis prometheus_client hypothesis yaml; do
  "$V" -c "import $mod" 2>/dev/null && continue
  pkg=$mod
  case $mod in
    pytest_timeout) pkg=pytest-timeout ;; grpc) pkg="grpcio grpcio-health-checking grpcio-reflection" ;;
    google.protobuf) pkg=protobuf ;; prometheus_client) pkg=prometheus-client ;; yaml) pkg=pyyaml ;;
  esac
  # shellcheck disable=SC2086
  "$V" -m pip install -q $pkg >>"$OUT/env.txt" 2>&1 || echo "could not install $pkg (offline?)" | tee -a "$OUT/env.txt"
done
"$V" -c 'import triton; print("triton", triton.__version__)' | tee -a "$OUT/env.txt"

# Compiled Triton, not the interpreter.
unset TRITON_INTERPRET
timeout 240 "$V" -m pytest -q -p no:cacheprovider --timeout=200 \
  tests/unit/test_triton_attention.py tests/unit/test_tensor_mover.py tests/unit/test_attention.py \
  2>&1 | tee "$OUT/tests.log"
echo "tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/tests.log"

timeout 300 "$V" -m bench.gpu --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "bench.gpu exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"

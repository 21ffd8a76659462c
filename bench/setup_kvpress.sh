#!/usr/bin/env bash
# Build bench/.venv-kvpress: a separate environment for the kvpress side of bench/kvpress_compare.py.
# kvpress 0.5.5 pins transformers < 5.3 while kvscope needs transformers 5.x, so the two cannot share a venv.
# torch is the same CPU build as the main venv (torch==2.13.0); pip takes it from PIP_FIND_LINKS when set.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv-kvpress"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==2.13.0" "kvpress==0.5.5"
"$venv/bin/python" - <<'PY'
import kvpress, torch, transformers
print(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5'}, "
      f"transformers {transformers.__version__}, torch {torch.__version__}")
PY

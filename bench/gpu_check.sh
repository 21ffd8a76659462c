#!/usr/bin/env bash
# GPU check for the eviction engine (see bench/gpu_check.py). Prepared for a machine with an NVIDIA GPU:
#   bash bench/gpu_check.sh                 # 8B-shaped random Llama, bf16, FlashAttention-2 if flash-attn is installed
#   bash bench/gpu_check.sh --context 32768 # longer context
#   bash bench/gpu_check.sh --small         # CPU mode: small model, SDPA (works anywhere, e.g. to smoke-test)
# After the decode check it measures the prefill memory of scoring (bench/prefill_memory.py: eager + output_attentions
# + H2O against SDPA + ValueDiff / EpiKV) on the same full-depth model from 1k to 64k tokens, into
# runs/gpu-check-prefill-memory/prefill_memory.csv (--prefill-ctx none skips it; --prefill-out moves it).
# Uses $PYTHON, else the repository's .venv, else python3; the interpreter needs torch (CUDA build for GPU runs) and
# transformers 5.x. Nothing is downloaded: the model is random-init.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" - <<'PY'
import importlib.util, torch, transformers
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()}), "
      f"transformers {transformers.__version__}, flash-attn {'yes' if importlib.util.find_spec('flash_attn') else 'no'}")
PY
exec "$python" bench/gpu_check.py "$@"

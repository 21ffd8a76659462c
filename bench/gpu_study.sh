#!/usr/bin/env bash
# One prepared study on a GPU, for one H200 when the project is lent one; never needed by CI:
#   bash bench/gpu_study.sh                  # $KVSCOPE_GPU_MODEL if set, else a random-init 8B-shaped Llama (bf16)
#   bash bench/gpu_study.sh --dry-run        # CPU: a tiny random Llama and 4 problems through the same steps
# Steps, each timed: (1) what the machine has (GPU, torch, transformers, flash-attn, vLLM); (2) the model: the named
# one, or a random-init Llama with Llama-3-8B's shape (32 layers, hidden 4096, 32 q / 8 kv heads of 128, MLP 14336;
# the vocabulary is kvscope's tiny tokenizer's, so every id decodes) saved once under $OUT/model; (3) dense traces by
# `tasks.run --engine vllm` where an interpreter has vLLM (tasks.engines.vllm_python), else `--engine hf` batched,
# saying which; (4) `python -m study` on those traces with KVSCOPE_REQUIRE_FLASH=1, so the eviction engine stops
# unless its prefill and first decode step ran FlashAttention (SDPA's flash backend or flash_attention_2,
# models/kernels.py); (5) the study's tables. Sized for <= 8 minutes on an H200 (N problems, T new tokens, all
# problems evicted in one batch); the total is printed and a longer run is flagged.
# Problems: $KVSCOPE_DATA_DIR/gsm8k_test.jsonl when present, else N generated "What is i + i?" problems. A random
# model answers neither, so its study labels nothing (every trace skipped: no answer to extract) and the selection is
# inconclusive: it measures the path (engines, kernels, timings), not findings; name a real model for those.
# Environment: $PYTHON (default .venv/bin/python, else python3), OUT (default runs/gpu-study, or runs/gpu-study-dry),
# N, T, KVSCOPE_GPU_MODEL. Nothing is downloaded.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ $# -gt 0 ]; then echo "bench/gpu_study.sh: error: unknown argument '$1'; valid: --dry-run" >&2; exit 2; fi
python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if [ "$dry" = 1 ]; then
  out="${OUT:-runs/gpu-study-dry}" n="${N:-4}" t="${T:-24}" shape=small
else
  out="${OUT:-runs/gpu-study}" n="${N:-8}" t="${T:-192}" shape=8b
fi
mkdir -p "$out"
start=$(date +%s)
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "machine"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$python" - <<'PY'
import importlib.util, torch, transformers
from core.errors import UsageError
from tasks.engines import vllm_python
try:
    vllm = vllm_python()
except UsageError as err:
    vllm = f"none ({err})"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}, available {torch.cuda.is_available()}), transformers "
      f"{transformers.__version__}, flash-attn {'yes' if importlib.util.find_spec('flash_attn') else 'no'}, vLLM: {vllm}")
PY
if [ "$dry" = 0 ] && ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu_study.sh: error: no CUDA device here; run with --dry-run on a CPU" >&2
  exit 2
fi

step "model"
model="${KVSCOPE_GPU_MODEL:-}"
labels=()
if [ -z "$model" ]; then
  labels=(--no-force-answer)  # a random model writes no answer cue: label from the answer boundary instead
  if [ "$dry" = 1 ]; then labels+=(--window 8 --stride 4 --tail 6); fi  # windows that fit T = 24 tokens
  model="$out/model-$shape"
  if [ ! -f "$model/config.json" ]; then
    "$python" - "$model" "$shape" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from bench.common import BIG, SMALL
from models.tiny import tiny_tokenizer

path, shape = sys.argv[1], sys.argv[2]
tokenizer = tiny_tokenizer()
fields = {**(BIG if shape == "8b" else SMALL), "vocab_size": len(tokenizer)}
cuda = torch.cuda.is_available()
config = LlamaConfig(**fields, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
with torch.device("cuda" if cuda else "cpu"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
model.save_pretrained(path)
tokenizer.save_pretrained(path)
print(f"random-init Llama {shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters in {path}")
PY
  fi
fi
echo "model: $model"

data="${KVSCOPE_DATA_DIR:-}/gsm8k_test.jsonl"
if [ -z "${KVSCOPE_DATA_DIR:-}" ] || [ ! -f "$data" ]; then
  data="$out/problems.jsonl"
  "$python" -c "import json, sys; open(sys.argv[1], 'w').writelines(json.dumps({'id': f'p{i}', 'question': f'What is {i} + {i}?', 'answer': str(2 * i)}) + '\n' for i in range(1, int(sys.argv[2]) + 1))" "$data" "$n"
fi
echo "problems: $data (first $n), $t new tokens"

step "dense traces"
engine=hf
if "$python" -c "from tasks.engines import vllm_python; vllm_python()" 2>/dev/null; then engine=vllm; fi
echo "engine: $engine$([ "$engine" = hf ] && echo " (no interpreter here has vLLM: batched HF instead)")"
"$python" -m tasks.run --model "$model" --dataset gsm8k --data-file "$data" --limit "$n" --max-new-tokens "$t" \
  --engine "$engine" --batch-size "$n" --out "$out/traces" --quiet

step "study (the evictor must run FlashAttention)"
KVSCOPE_REQUIRE_FLASH=1 "$python" -m study --model "$model" --dataset gsm8k --data-file "$data" --limit "$n" \
  --max-new-tokens "$t" --traces "$out/traces/generations.jsonl" --include-incorrect --budget 0.5 \
  --max-answer-tokens 32 --batch-size "$n" "${labels[@]}" --quiet --out "$out/study"

step "tables"
"$python" - "$out" <<'PY'
import csv, json, sys
from pathlib import Path

out = Path(sys.argv[1])
summary = json.loads((out / "traces" / "summary.json").read_text())
print(f"traces: {summary['problems']} problems, engine {summary['engine']}, median {summary['median_tokens_per_s']} tok/s")
for name in ("accuracy.csv", "compare.csv"):
    path = out / "study" / name
    if path.exists():
        rows = list(csv.DictReader(path.open()))
        print(f"\n{name} ({len(rows)} rows)")
        for row in rows[:12]:
            print("  " + ", ".join(f"{k}={v}" for k, v in list(row.items())[:8]))
print(f"\nreport: {out / 'study' / 'report.md'}")
PY
total=$(( $(date +%s) - start ))
echo; echo "total: $total s$([ "$total" -gt 480 ] && echo " (over the 8-minute budget: lower N or T)")"

# The two README commands. Each sets up .venv first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
OUT ?= runs/demo

.PHONY: setup demo test test-slow bench
setup:
	@bash scripts/setup.sh

demo: setup
	@source scripts/env.sh && $(PY) -m study --model smollm2-135m --dataset gsm8k --limit 4 --max-new-tokens 160 \
		--include-incorrect --budget 0.5 --out $(OUT)

test: setup
	@source scripts/env.sh && $(PY) -m ruff check . && $(PY) -m pytest -m "not slow" -q

test-slow: setup
	@source scripts/env.sh && $(PY) -m pytest -m slow -q

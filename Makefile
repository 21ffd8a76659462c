# The two README commands. Each sets up .venv first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
OUT ?= runs/demo

.PHONY: setup demo test test-slow bench
setup:
	@bash scripts/setup.sh

demo: setup
	@source scripts/env.sh && $(PY) -m tasks.run --model smollm2-135m --dataset math500 --limit 5 --max-new-tokens 256 --out $(OUT)

test: setup
	@source scripts/env.sh && $(PY) -m pytest -m "not slow" -q

test-slow: setup
	@source scripts/env.sh && $(PY) -m pytest -m slow -q

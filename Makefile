# The two README commands. Each sets up .venv first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
OUT ?= runs/demo

.PHONY: setup demo test test-slow bench
setup:
	@bash scripts/setup.sh

demo: setup
	@source scripts/env.sh && $(PY) -m study --model smollm2-135m --dataset known_facts --limit 6 --max-new-tokens 8 \
		--budget 0.5 --stride 32 --agreement-traces 2 --batch-size 1 --scorers epikv,valuediff,keydiff,h2o,recency,random \
		--out $(OUT)

test: setup
	@source scripts/env.sh && $(PY) -m ruff check . && $(PY) -m mypy && $(PY) -m pytest -m "not slow" -q

test-slow: setup
	@source scripts/env.sh && $(PY) -m pytest -m slow -q

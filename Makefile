# The two README commands. Each sets up .venv first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
OUT ?= runs/demo

# JupyterLab's extra flags, e.g. LAB_ARGS="--port=8899 --ip=0.0.0.0", or --ServerApp.open_browser=True to open one
LAB_ARGS ?=

.PHONY: setup demo test test-slow bench lab
setup:
	@bash scripts/setup.sh

# The study of a known-answer case recency cannot win (the needed fact stated twice, both copies before a decoy);
# its output ends with the report's path and its trace viewer's (figures.trace).
demo: setup
	@source scripts/env.sh && $(PY) -m study --model smollm2-135m --dataset known_facts@1+first+twice --limit 6 \
		--max-new-tokens 8 --budget 0.5 --stride 32 --agreement-traces 2 --batch-size 1 --labels token,joint \
		--scorers epikv,valuediff,keydiff,h2o,recency,random --out $(OUT)

# JupyterLab on notebooks/: it prints the URL with its access token and opens no browser (as root, e.g. in a
# container, it must be allowed to run as root).
lab: setup
	@source scripts/env.sh && .venv/bin/jupyter lab --ServerApp.root_dir=notebooks --no-browser \
		$$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

test: setup
	@source scripts/env.sh && $(PY) -m ruff check . && $(PY) -m mypy && $(PY) -m pytest -m "not slow" -q

test-slow: setup
	@source scripts/env.sh && $(PY) -m pytest -m slow -q

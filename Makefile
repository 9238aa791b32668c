# The two entry points of the README. Each creates or refreshes .venv (plain pip, idempotent) first.
SPEC ?= deploy/local.yaml
PROMPT ?= Write a haiku about the sea.
PYTEST_ARGS ?=

.PHONY: venv run generate test bench

venv:
	@bash scripts/setup_venv.sh

run: venv
	.venv/bin/pdserve serve $(SPEC)

generate: venv
	.venv/bin/pdserve generate --chat --stream "$(PROMPT)"

test: venv
	.venv/bin/python -m pytest tests -n 2 --dist loadgroup --durations=20 $(PYTEST_ARGS)

bench: venv
	.venv/bin/python bench/engine/engine_bench.py

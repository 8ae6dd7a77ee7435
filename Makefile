# The template's two entry points: `make demo` (bake and train) and `make test` (the whole suite).
# Both create the pinned environment in .venv on first use.

# The environment's Python: the newest here without the fork deadlock of CPython before 3.11.8 and 3.12.2
# (python/cpython#112275; DataLoader workers start by fork, and one whole-suite run in about seven hung in
# one), pyenv's included; else python3. Choose another with `make test PYTHON=...`.
ifneq ($(filter default undefined,$(origin PYTHON)),)
PYTHON := $(shell for p in python3.13 python3.12 $$(pyenv root 2>/dev/null)/versions/3.1[2-9]*/bin/python3 python3; do \
	"$$p" -c 'import sys; v = sys.version_info; sys.exit(not (v >= (3, 12, 2) or (3, 11, 8) <= v < (3, 12)))' \
	2>/dev/null && { echo "$$p"; break; }; done)
endif
PYTHON := $(or $(PYTHON),python3)
VENV := .venv
BIN := $(abspath $(VENV))/bin
# Named after the Python it was made with: another Python, or new requirements, make it again from scratch.
INSTALLED := $(VENV)/.installed-$(shell $(PYTHON) -c 'import platform; print(platform.python_version())' 2>/dev/null)
DEMO_DIR := build/demo
DEMO_PROJECT := $(DEMO_DIR)/ddp-training
# Small images and a small fake set so the demo takes about a minute on 2 CPU cores.
DEMO_ARGS := --data fake --fake-samples 1024 --image-size 16 --batch-size 16 --num-workers 1 \
	--ckpt-dir checkpoints --ckpt-every 20 --log-every 10

.PHONY: venv demo test test-fast lint clean

venv: $(INSTALLED)

$(INSTALLED): requirements-dev.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

demo: $(INSTALLED)
	rm -rf $(DEMO_DIR)
	$(BIN)/cookiecutter --no-input --output-dir $(DEMO_DIR) .
	@echo "=== 2 CPU ranks train for 40 steps, checkpointing every 20"
	cd $(DEMO_PROJECT) && PATH="$(BIN):$$PATH" NPROC_PER_NODE=2 ./run_node.sh $(DEMO_ARGS) --max-steps 40
	@echo "=== the same command with a higher step limit resumes from step 40 instead of starting over"
	cd $(DEMO_PROJECT) && PATH="$(BIN):$$PATH" NPROC_PER_NODE=2 ./run_node.sh $(DEMO_ARGS) --max-steps 60
	@echo "=== baked project: $(DEMO_PROJECT)"

# Two pytest-xdist workers on two cores: with three, the suite took as long (9:43-13:32 against 10:08) and 5-20 %
# more CPU-seconds, its processes slowed by one another (benchmarks/README.md).
# --dist loadgroup keeps each xdist_group (a shared reference run, a test cluster's fixed ports) on one worker.
TEST_WORKERS ?= 2

test: $(INSTALLED) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup tests

# For edit loops: everything that starts no torchrun job, plus one 2-rank training run (30 to 70 seconds).
test-fast: $(INSTALLED) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests

lint: $(INSTALLED)
	$(BIN)/ruff check benchmarks tests tools  # hooks and the project are Jinja, linted once baked
	$(BIN)/shellcheck .ci/run .ci/other_pythons .ci/torch_versions

clean:
	rm -rf $(VENV) build .pytest_cache

# The template's two entry points: `make demo` (bake and train) and `make test` (the whole suite).
# Both create the pinned environment in .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
INSTALLED := $(VENV)/.installed
DEMO_DIR := build/demo
DEMO_PROJECT := $(DEMO_DIR)/ddp-training
# Small images and a small fake set so the demo takes about a minute on 2 CPU cores.
DEMO_ARGS := --data fake --fake-samples 1024 --image-size 16 --batch-size 16 --num-workers 1 \
	--ckpt-dir checkpoints --ckpt-every 20 --log-every 10

.PHONY: venv demo test test-fast lint clean

venv: $(INSTALLED)

$(INSTALLED): requirements-dev.txt
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

# Three pytest-xdist workers on two cores: much of the suite waits (a 32 s save, Slurm, rendezvous timeouts).
# --dist loadgroup keeps each xdist_group (a shared reference run, a test cluster's fixed ports) on one worker.
TEST_WORKERS ?= 3

test: $(INSTALLED) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup tests

# For edit loops: everything that starts no torchrun job, plus one 2-rank training run (about half a minute).
test-fast: $(INSTALLED) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" tests

lint: $(INSTALLED)
	$(BIN)/ruff check benchmarks tests  # hooks and the project are Jinja, linted once baked
	$(BIN)/shellcheck .ci/run .ci/other_pythons .ci/torch_versions

clean:
	rm -rf $(VENV) build .pytest_cache

# Everything a fresh machine needs: `make train` and `make test` install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOGDIR ?= /tmp/lingvo_gpipe/amoeba_net_tiny
MODEL ?= image.AmoebaNetTiny
DEVICES ?= cpu:2
# The full TensorFlow wheel (with its GPU kernels), for the GPU audit only: its own venv,
# so the CPU install stays tensorflow-cpu.
GPU_VENV ?= .venv-gpu

.PHONY: install train test test-all lint clean gpu-audit

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	# KerasHub's layers, for the tests of Keras models built from them: without its
	# dependencies, whose `tensorflow` would replace tensorflow-cpu (docs/keras.md).
	$(PY) -m pip install --no-deps keras-hub==0.32.0 tokenizers==0.23.3
	touch $@

# Trains the default model offline (AmoebaNetTiny pipelined over 2 logical CPU devices,
# 4 micro-batches), writes TensorBoard logs to $(LOGDIR), then prints its eval accuracy.
train: install
	$(PY) tools/trainer.py --model=$(MODEL) --devices=$(DEVICES) --logdir=$(LOGDIR) \
	  --mode=train_and_eval

# The quick tier (about 3 minutes on 2 cores): every test file and feature, the covering
# grids sampled (tests/tiers.py). test-all: every test, what CI runs.
test: install
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not exhaustive" tests

test-all: install
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# Every op of every paper model's training step has a GPU kernel (no GPU needed):
# tools/gpu_audit.py over the whole grid, then the audit's own tests with GPU kernels.
gpu-audit: $(GPU_VENV)/.installed
	$(GPU_VENV)/bin/python tools/gpu_audit.py
	$(GPU_VENV)/bin/python -m pytest -q tests/placement_audit_test.py tests/tf_internals_test.py

$(GPU_VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	LINGVO_GPIPE_TF_REQUIREMENT='tensorflow==2.21.0' $(GPU_VENV)/bin/pip install -e '.[test]'
	touch $@

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(GPU_VENV) *.egg-info .pytest_cache

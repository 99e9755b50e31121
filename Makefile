# Everything a fresh machine needs: `make train` and `make test` install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOGDIR ?= /tmp/lingvo_gpipe/amoeba_net_tiny
MODEL ?= image.AmoebaNetTiny
DEVICES ?= cpu:2

.PHONY: install train test lint clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	touch $@

# Trains the default model offline (AmoebaNetTiny pipelined over 2 logical CPU devices,
# 4 micro-batches), writes TensorBoard logs to $(LOGDIR), then prints its eval accuracy.
train: install
	$(PY) tools/trainer.py --model=$(MODEL) --devices=$(DEVICES) --logdir=$(LOGDIR) \
	  --mode=train_and_eval

test: install
	$(PY) -m pytest -q -n 2 --dist worksteal tests

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

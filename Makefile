# kvroute — every target creates the local virtualenv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench soak lint sim-mooncake compare clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

## The main job: the embedded default (no ../shared needed).
run: $(STAMP)
	$(BIN)/kvroute demo

test: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all $(ONLY)

## A bounded chaos soak (benchmarks/soak.py): ~3,000 requests through 2 replicas x 2 workers before
## 4 emulated engines, with faults and bad inputs; a few minutes on 2 cores; writes benchmarks/results/soak.json.
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

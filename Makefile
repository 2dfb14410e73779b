# hfkit: the two README commands are `make report` (the main job) and `make test`.
# Each creates .venv on first use and installs what it needs into it.

PYTHON ?= python3
VENV   ?= .venv
# The torch build to install first. The pin takes a local CPU wheel where one is on disk and the
# default (CUDA) build from PyPI elsewhere; override with e.g. TORCH_SPEC='torch>=2.5'.
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.hfkit-installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: help setup report test bench lint format strip clean

help:
	@echo "make report  - run every notebook in order on the best device; executed notebooks + HTML in reports/"
	@echo "make test    - ruff, pytest (Triton kernels under TRITON_INTERPRET=1 on CPU) and nbmake on the notebooks"
	@echo "make bench   - (GPU) every benchmark; results in data/results/<gpu>/, each file with its command"
	@echo "make lint    - ruff check + ruff format --check"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[notebooks,dev]"
	touch $(STAMP)

setup: $(STAMP)

report: $(STAMP)
	mkdir -p reports
	@for nb in $(NOTEBOOKS); do \
	  echo "== $$nb"; \
	  $(BIN)/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=3600 \
	    --output-dir reports "$$nb" || exit 1; \
	  $(BIN)/jupyter nbconvert --to html --output-dir reports "reports/$$(basename $$nb)" || exit 1; \
	done
	@echo "reports written to reports/"

# The notebooks run once more, the failed ones only, if the first run fails: nbclient and the kernel
# have intermittently lost a message here (with ipykernel 7.4 twice, with 6.31 once, always inside the
# whole suite, never in a notebook run alone), the kernel idle and the client waiting forever. The per-cell timeout turns such a wait into a failure;
# a notebook that really fails fails twice.
NBMAKE = HFKIT_PROFILE=smoke TRITON_INTERPRET=1 $(BIN)/python -m pytest notebooks --nbmake --nbmake-timeout=600 -q

test: $(STAMP) lint
	HFKIT_PROFILE=smoke $(BIN)/python -m pytest tests -q
	$(NBMAKE) || $(NBMAKE) --last-failed

# Every benchmark on the current GPU, one process each (a failure stops the list). The kernel and
# model benchmarks save their rows as they go, so a run cut short keeps what it measured. Peers
# (trifast, cuEquivariance) are measured when installed and skipped with the reason otherwise.
BENCHES := layer_norm softmax evoformer_attention triangle_multiplication elementwise model

bench: $(STAMP)
	@for b in $(BENCHES); do echo "== hfkit bench $$b"; $(BIN)/hfkit bench $$b --no-progress || exit 1; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

strip: $(STAMP)
	$(BIN)/nbstripout notebooks/*.ipynb

clean:
	rm -rf reports .pytest_cache .ruff_cache

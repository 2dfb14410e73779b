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

# 1 where this machine has no CUDA device (Triton kernels then run under the interpreter), else 0. A
# kernel reads TRITON_INTERPRET when it starts, so it is set here, never inside a notebook.
NO_CUDA = $$($(BIN)/python -c 'import torch; print(0 if torch.cuda.is_available() else 1)')
# Seconds one notebook cell may run in `make report` before it fails with its cell named (the longest
# cells, the GPU benchmarks of notebooks 02 and 04, take a few minutes).
REPORT_CELL_TIMEOUT ?= 900

# Every notebook runs (a failure does not stop the others) in a fresh kernel with a per-cell timeout;
# the executed notebook and its HTML go to reports/, the HTML loading the one reports/plotly.min.js.
# A failure prints nbclient's error and `make report: <notebook> failed at cell N`; the target fails
# at the end. docs/results.md is then regenerated from data/results/.
report: $(STAMP)
	mkdir -p reports
	cp "$$($(BIN)/python -c 'from hfkit.viz import plotly_js_path; print(plotly_js_path())')" reports/plotly.min.js
	@failed=""; for nb in $(NOTEBOOKS); do \
	  echo "== $$nb"; \
	  TRITON_INTERPRET=$(NO_CUDA) $(BIN)/python -m hfkit.viz.execute "$$nb" --output-dir reports \
	    --cell-timeout $(REPORT_CELL_TIMEOUT) || failed="$$failed $$nb"; \
	  $(BIN)/jupyter nbconvert --to html --output-dir reports "reports/$$(basename $$nb)" || failed="$$failed $$nb"; \
	done; \
	$(BIN)/hfkit report || failed="$$failed docs/results.md"; \
	if [ -n "$$failed" ]; then echo "make report: failed:$$failed (see the messages above)"; exit 1; fi
	@echo "reports written to reports/"

# The notebooks run once more, the failed ones only, if the first run fails, and the per-cell timeout
# turns a stalled cell into a failure. nbclient can miss a cell's reply while it mirrors output captured
# by an ipywidgets Output area back to the kernel on the shell channel it waits on (jupyter/nbclient#312),
# so hfkit.viz's panels never capture: they set the Output's state (hfkit.viz.notebook.render_into).
NBMAKE = HFKIT_PROFILE=smoke TRITON_INTERPRET=$(NO_CUDA) $(BIN)/python -m pytest notebooks --nbmake --nbmake-timeout=600 -q

test: $(STAMP) lint
	HFKIT_PROFILE=smoke $(BIN)/python -m pytest tests -q
	$(NBMAKE) || $(NBMAKE) --last-failed

# Every benchmark on the current GPU, one process each (a failure stops the list). The kernel and
# model benchmarks save their rows as they go, so a run cut short keeps what it measured. Peers
# (trifast, cuEquivariance) are measured when installed and skipped with the reason otherwise.
BENCHES := layer_norm softmax evoformer_attention triangle_multiplication elementwise outer_product_linear model

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

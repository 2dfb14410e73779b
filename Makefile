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

.PHONY: help setup report test bench bench-multigpu lint format strip clean

help:
	@echo "make report  - run every notebook in order on the best device; executed notebooks + HTML in reports/"
	@echo "make test    - ruff, pytest (Triton kernels under TRITON_INTERPRET=1 on CPU) and nbmake on the notebooks"
	@echo "make bench   - (GPU) every benchmark; results in data/results/<gpu>/, each file with its command"
	@echo "make bench-multigpu GPUS=8 - (GPUs) comms, DAP scaling and DAP inference on 2..8 GPUs; SMOKE=1 rehearses"
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

# Issue 20's runs on one host of GPUS GPUs (2, 4 or 8; NCCL_NVLS_ENABLE=0), for G = 2, 4, ... GPUS:
# allreduce per backend and the DDP step, DAP blocks at af2_initial and af2_finetune sizes (from Python,
# and as CUDA graphs: the GPU work that scales, GPUs only), the 48-block
# checkpointed stack, chunked DAP inference from N = 4096 up until a size does not run (each size its
# own run, at most 300 s: ranks that wait on one out of memory give up at the group's timeout); then a
# dp x dap layout on all GPUS. Results go to data/results/<gpu>x<G>/. `SMOKE=1` rehearses the
# same commands at the smoke sizes (on a CPU: gloo processes) with results under $(MG_SMOKE_OUT).
GPUS ?= 2
SMOKE ?=
MG_SMOKE_OUT ?= /tmp/hfkit-multigpu-smoke
MG_RUN   = $(if $(SMOKE),--profile smoke --warmup 0 --reps 1 --no-progress,--no-progress)
MG_FT    = $(if $(SMOKE),--n-seq 8 --sizes 12,--n-seq 512 --sizes 384)
MG_STACK = $(if $(SMOKE),2,48)
MG_LONG  = $(if $(SMOKE),24 32,4096 8192 12288 16384 24576 32768)
MG_CHUNK = $(if $(SMOKE),8,64)
MG_COMMS = $(if $(SMOKE),--max-bytes 64K --params 100000 --ddp-reps 1,)
mg_out   = $(if $(SMOKE),--out $(MG_SMOKE_OUT)/x$(1)/$(2),)

bench-multigpu: $(STAMP)
	@set -e; export NCCL_NVLS_ENABLE=0; g=2; while [ $$g -le $(GPUS) ]; do \
	  echo "== $$g processes"; \
	  $(BIN)/hfkit bench comms --nproc $$g $(MG_COMMS) $(call mg_out,$$g,comms.json); \
	  dap="$(BIN)/hfkit bench dap --nproc $$g $(MG_RUN) $(call mg_out,$$g,dap.json)"; \
	  $$dap --modes fwd+bwd; \
	  $$dap --modes fwd+bwd $(MG_FT) --append; \
	  $(if $(SMOKE),,$$dap --modes fwd+bwd --launch graph --append; \
	  $$dap --modes fwd+bwd $(MG_FT) --launch graph --append;) \
	  $$dap --modes fwd+bwd --blocks $(MG_STACK) --checkpoint --append; \
	  for n in $(MG_LONG); do \
	    $$dap --modes fwd --sizes $$n --chunk-size $(MG_CHUNK) --providers dap_overlap --warmup 1 --reps 2 --append \
	      --timeout 300 || { echo "bench-multigpu: N = $$n does not run on $$g processes (see above)"; break; }; \
	  done; \
	  g=$$((g * 2)); \
	done; \
	echo "== dp x dap on $(GPUS) processes"; \
	$(BIN)/hfkit bench dap --nproc $(GPUS) --dap-size $$(($(GPUS) / 2)) --modes fwd+bwd $(MG_RUN) \
	  $(call mg_out,$(GPUS),dap.json) --append

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

# llm.cupy: every target only wraps a command; `make help` lists them.
PYTHON ?= python3
PIP    ?= $(PYTHON) -m pip
STAMP  := .setup-done

.PHONY: help setup data train train-cpu test test-gpu bench bench-cpu compile-kernels dev-cuda clean

help:            ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

# setup: idempotent. Installs the runtime and test requirements once (a stamp file remembers it)
# and builds the default dataset. `make setup PIP="pip --user"` to change how pip is called.
setup: $(STAMP) data ## install requirements and build the Shakespeare data

$(STAMP): requirements.txt requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	@touch $(STAMP)

data: $(STAMP)   ## tokenize Shakespeare into data/ (does nothing if it is there)
	$(PYTHON) dev/data/tinyshakespeare.py

# train: the GPU trainer where CuPy sees a CUDA GPU, else the NumPy trainer, saying so.
train: setup     ## train GPT-2 on Shakespeare (GPU if present, else CPU)
	@if $(PYTHON) -c "import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() == 0)" 2>/dev/null \
	   && [ -f gpt2_cuda.py ]; then \
	  $(PYTHON) gpt2_cuda.py $(ARGS); \
	else \
	  echo "make train: no CUDA GPU (or no CuPy) here: running the NumPy trainer gpt2_cpu.py instead"; \
	  $(PYTHON) gpt2_cpu.py $(ARGS); \
	fi

train-cpu: setup ## train with the NumPy trainer (ARGS="-x 50" passes flags)
	$(PYTHON) gpt2_cpu.py $(ARGS)

test: setup      ## run the test suite (GPU tests skip without a GPU)
	$(PYTHON) -m pytest -q

test-gpu: setup  ## run only the GPU tests, saving the output under dev/results/
	$(PYTHON) dev/run_gpu_tests.py

compile-kernels: setup ## compile every kernels/*.cu and dev/cuda/*.cu with NVRTC for sm_80 and sm_90 (no GPU needed)
	$(PYTHON) dev/cuda/nvrtc_compile.py --dev

dev-cuda: setup  ## run every dev/cuda progression on a GPU, one table per op in dev/results/ (ARGS="-p fp32")
	$(PYTHON) dev/cuda/run_all.py $(ARGS)

bench: setup     ## GPU benchmark: gpt2_cuda.py vs the PyTorch twin (needs a GPU)
	$(PYTHON) dev/bench.py

bench-cpu: setup ## CPU benchmark: the NumPy step vs its matmuls alone
	$(PYTHON) dev/bench_cpu.py

sanitize:        ## every kernel on the emulated device under ThreadSanitizer, then ASan + UBSan (g++, no GPU)
	$(PYTHON) dev/sanitize_kernels.py

clean:           ## remove the setup stamp and caches (keeps data/)
	rm -rf $(STAMP) .pytest_cache __pycache__ */__pycache__

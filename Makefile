# llm.cupy: every target only wraps a command; `make help` lists them.
# Each target first runs dev/setup_env.py, which installs what that target needs and nothing that
# already works, into the active virtual environment, else into .venv (created once, said in one
# line). PY is the interpreter the commands then run with.
PYTHON ?= python3
SETUP   = $(PYTHON) dev/setup_env.py
PY     := $(shell $(PYTHON) dev/setup_env.py --python)
export PATH := $(dir $(PY)):$(PATH)

.PHONY: help data train train-cpu debug finetune twin test test-gpu bench bench-cpu compile-kernels dev-cuda gpu-wheels sanitize clean

help:            ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

data:            ## tokenize Shakespeare into data/ (does nothing if it is there; needs numpy, tiktoken)
	$(SETUP) data
	$(PY) dev/data/tinyshakespeare.py

# train: the GPU trainer where CuPy sees a CUDA GPU, else the NumPy trainer, saying why.
train: data      ## train GPT-2 on Shakespeare (GPU if present, else CPU; ARGS="-x 50" passes flags); installs matplotlib, safetensors, tqdm too
	$(SETUP) train
	@trainer=$$($(PY) dev/setup_env.py --trainer) && echo "$(PY) $$trainer $(ARGS)" && $(PY) $$trainer $(ARGS)

train-cpu: data  ## train with the NumPy trainer (ARGS="-x 50" passes flags)
	$(PY) gpt2_cpu.py $(ARGS)

debug: data      ## the visual debugger: a training step op by op in the browser (prints a URL; ARGS="-e llama3:d4")
	$(SETUP) debug
	$(PY) -m llmc.debugger $(ARGS)

# finetune: LoRA on the README's default run. Its base is log_d4/model_00000400.bin (`python gpt2_cpu.py
# -o log_d4 -n 400`, trained here first if missing: about two minutes), fine-tuned on Shakespeare's
# Sonnets (dev/data/sonnets.py), which it never saw, with rank-8 adapters on every linear layer: the
# val loss on the Sonnets at step 0 is the base model's, the last one the fine-tuned model's. Then the
# adapters are merged into a model file, which samples a sonnet's opening.
FINETUNE_BASE = log_d4/model_00000400.bin
FINETUNE_DIR = log_sonnets_lora
finetune: data   ## LoRA: fine-tune the default d4 on the Sonnets, val loss before and after (ARGS passes flags)
	$(SETUP) train
	$(PY) dev/data/sonnets.py
	test -f $(FINETUNE_BASE) || $(PY) gpt2_cpu.py -o log_d4 -n 400 -s 0
	$(PY) gpt2_cpu.py -e $(FINETUNE_BASE) -i data/sonnets/sonnets_train.bin -j data/sonnets/sonnets_val.bin -m -1 \
		-x 300 -v 100 -s 0 -l 3e-3 --lora-rank 8 --lora-targets all-linear --lora-save $(FINETUNE_DIR)/adapters $(ARGS)
	$(PY) gpt2_cpu.py -e $(FINETUNE_BASE) --lora-load $(FINETUNE_DIR)/adapters --lora-merge $(FINETUNE_DIR)/model.bin
	$(PY) gpt2_cpu.py -e $(FINETUNE_DIR)/model.bin --generate 48 --prompt "Shall I compare thee" --temperature 0.8 --top-k 40

twin:            ## install torch (about 2 GB) for the PyTorch twins, dev/torch_reference.py and dev/torch_reference_llama3.py
	$(SETUP) twin

test:            ## run the test suite (GPU tests skip without a GPU)
	$(SETUP) test
	$(PY) dev/data/tinyshakespeare.py
	$(PY) -m pytest -q

test-gpu:        ## run every GPU test and check, log under dev/results/ (ARGS="--quick")
	$(SETUP) test-gpu
	$(PY) dev/run_gpu_tests.py $(ARGS)

compile-kernels: ## compile every kernels/*.cu and dev/cuda/*.cu with NVRTC for sm_80 and sm_90 (no GPU needed)
	$(SETUP) compile-kernels
	$(PY) dev/cuda/nvrtc_compile.py --dev

dev-cuda:        ## run every dev/cuda progression on a GPU, one table per op in dev/results/ (ARGS="-p fp32")
	$(SETUP) dev-cuda
	$(PY) dev/cuda/run_all.py $(ARGS)

bench:           ## GPU benchmark: gpt2_cuda.py vs the PyTorch twin (needs a GPU, no data; ARGS="-e llama3:d4" for llama3_cuda.py)
	$(SETUP) bench
	$(PY) dev/bench.py $(ARGS)

bench-cpu:       ## CPU benchmark: the NumPy step vs PyTorch's CPU step and vs its matmuls alone (about a minute; ARGS="-e llama3:d4")
	$(SETUP) bench-cpu
	$(PY) dev/bench_cpu.py $(ARGS)

gpu-wheels:      ## download into .whl/ the wheels the offline GPU machine lacks (dev/results/README.md)
	$(SETUP) gpu-wheels

sanitize:        ## every kernel on the emulated device under ThreadSanitizer, then ASan + UBSan (g++, no GPU)
	$(SETUP) test
	$(PY) dev/sanitize_kernels.py $(ARGS)

clean:           ## remove caches (keeps data/, .venv/, .whl/ and .emulator-cache/)
	rm -rf .pytest_cache __pycache__ */__pycache__

# flash-attn4 developer commands. Run from the repository root; PYTHON selects the interpreter.
PYTHON ?= python
ARCH ?= sm_90a
BUILD_DIR ?= build

.PHONY: help setup build aot compile sass-report test test-gpu fuzz fuzz-gpu sanitize demo bench bench-decode clean

# A bare `make` lists the targets and does nothing else (installing is `make setup`, asked for by name).
.DEFAULT_GOAL := help

# torch is installed first and explicitly: `torch==2.13.0` is the CPU wheel that pip takes from
# local disk on this project's machines. On a GPU machine, install the CUDA build of torch you want
# first and run `make setup TORCH=` to keep it.
TORCH ?= torch==2.13.0

help: ## this list
	@echo "flash-attn4: make TARGET [VAR=value]; first time: python -m venv .venv && . .venv/bin/activate && make setup"
	@sed -n 's/^\([a-z-]*\):.*## \(.*\)/  make \1|\2/p' $(MAKEFILE_LIST) | awk -F'|' '{ printf "%-20s %s\n", $$1, $$2 }'

# Pinned dependencies and the package itself (editable, with the dev extras).
setup: ## install torch (TORCH=...; TORCH= keeps yours), then this package editable with the dev extras
	$(if $(TORCH),$(PYTHON) -m pip install "$(TORCH)")
	$(PYTHON) -m pip install -e ".[dev]"

# The Hub tree: $(BUILD_DIR)/torch-cuda/ (module files, generated _ops.py, metadata.json) with the
# precompiled kernels of `make aot` as flash_attn4/aot/. AOT= builds the tree without them.
AOT ?= 1
build: $(if $(AOT),aot) ## the Hub tree in build/torch-cuda/ with the AOT kernels (BUILD_DIR=..., AOT= skips them)
	$(PYTHON) scripts/build_hub.py --build-dir $(BUILD_DIR) $(if $(AOT),--aot-dir $(BUILD_DIR)/aot)

# The precompiled kernel set (docs/AOT.md), cross-compiled on the CPU with AOT_JOBS processes.
AOT_ARCHS ?= sm_90a sm_100a
AOT_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# AOT_SHARD=K/N compiles every N-th configuration from the K-th only: CI's check that the shipped
# set builds, a different eighth per commit (.ci/run); such a build/aot is not a set to ship.
AOT_SHARD ?=
aot: ## precompile the shipped kernel set into build/aot/ (AOT_ARCHS="sm_90a sm_100a", AOT_JOBS=N, AOT_SHARD=K/N)
	rm -rf $(BUILD_DIR)/aot
	$(PYTHON) scripts/build_aot.py --out $(BUILD_DIR)/aot -j $(AOT_JOBS) $(foreach a,$(AOT_ARCHS),--arch $(a)) \
	  $(if $(AOT_SHARD),--shard $(AOT_SHARD))

# Compile the kernel set for ARCH without a GPU; an arch without kernels is an error. The module is
# run as flash_attn4.fa4_kernels.compile from torch-ext/ (this tree's, not an installed copy),
# which works from any directory.
compile: ## compile ARCH's kernel set without a GPU (ARCH=sm_90a, sm_100a, sm_103a)
	PYTHONPATH="$(CURDIR)/torch-ext$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m flash_attn4.fa4_kernels.compile --arch $(ARCH)

# Static facts of every kernel of ARCH's set under both embedded ptxas versions, no GPU: MMAs,
# exponentials, spills, registers, TMEM, the DSL verifier; ANCHORS=DIR adds upstream's numbers
# (../shared/sm100/compile_anchor.py --out DIR). STRICT=1 fails on a static problem (spills...).
sass-report: ## static SASS facts of ARCH's kernel set (no GPU; ANCHORS=DIR, STRICT=1)
	$(PYTHON) scripts/sass_report.py set --arch $(ARCH) --flavour both --verify \
	  $(if $(ANCHORS),--anchors $(ANCHORS)) $(if $(STRICT),--strict)

# Test processes (pytest-xdist): kernel compiles are most of both suites' time and run in parallel.
# The CPU suite is dealt by work stealing: each process starts on its own half (whole runs of
# modules, so the two seldom need the same kernel at once; tests/conftest.py lets them share what
# both compile) and takes tests from the other's queue once its own is empty.
TEST_WORKERS ?= 2
GPU_TEST_WORKERS ?= 4

# CPU tests. pytest exits 5 when it collected no test: that is a failure here, said out loud.
test: ## CPU tests: python -m pytest tests -m "not gpu" -q -n 2 --dist worksteal (TEST_WORKERS=...)
	$(PYTHON) -m pytest tests -m "not gpu" -q -n $(TEST_WORKERS) --dist worksteal; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# GPU tests: need an sm90/sm100 GPU, skipped otherwise.
test-gpu: ## GPU tests (an sm90/sm100 GPU; skipped otherwise)
	$(PYTHON) -m pytest tests -m gpu -q -n $(GPU_TEST_WORKERS)

# Reliability (docs/VERIFICATION.md, "Reliability"). fuzz: the CPU parts, hypothesis over the public
# functions' arguments and the kernel disk cache under faults (real sm_90a compiles, no GPU).
fuzz: ## CPU fuzzing of the API arguments + the disk cache under faults (no GPU)
	$(PYTHON) -m pytest tests/cpu/test_fuzz_api.py tests/cpu/test_compile_cache_faults.py -q -n $(TEST_WORKERS)

# fuzz-gpu: random valid problems against the reference, random invalid calls, a sanity call after;
# FUZZ_TIME bounds the run (the first run mostly compiles the FUZZ_TEMPLATES configurations).
FUZZ_VALID ?= 2000
FUZZ_INVALID ?= 500
FUZZ_SEED ?= 0
FUZZ_TIME ?= 540
FUZZ_TEMPLATES ?= 24
fuzz-gpu: ## bounded GPU fuzz vs the reference (FUZZ_VALID, FUZZ_INVALID, FUZZ_SEED, FUZZ_TIME)
	$(PYTHON) scripts/fuzz_gpu.py --valid $(FUZZ_VALID) --invalid $(FUZZ_INVALID) --seed $(FUZZ_SEED) \
	  --time-limit $(FUZZ_TIME) --templates $(FUZZ_TEMPLATES)

# sanitize: each compute-sanitizer tool over scripts/sanitize_calls.py; any finding fails the target.
# The caching allocator is off so that memcheck sees each tensor's own bounds, not the pool's.
# initcheck runs with O stored by threads: it cannot see TMA stores (scripts/sanitize_calls.py).
SANITIZER ?= compute-sanitizer
SANITIZE_TOOLS ?= memcheck racecheck synccheck initcheck
sanitize: ## compute-sanitizer memcheck/racecheck/synccheck/initcheck on small calls (GPU)
	@rc=0; for tool in $(SANITIZE_TOOLS); do \
	  echo "== $(SANITIZER) --tool $$tool"; \
	  PYTORCH_NO_CUDA_MEMORY_CACHING=1 $(SANITIZER) --tool $$tool --report-api-errors no --error-exitcode 1 \
	    $(PYTHON) scripts/sanitize_calls.py $$( [ $$tool = initcheck ] && echo --thread-stored-o ) \
	    || { echo "== $$tool: FAILED"; rc=1; }; \
	done; exit $$rc

demo: ## build, load as a Hub kernel, run (GPU) or compile (no GPU)
	$(PYTHON) scripts/demo.py

bench: ## benchmark against the other implementations (options: benchmarks/README.md)
	$(PYTHON) benchmarks/bench.py

bench-decode: ## decoding benchmark (split-KV)
	$(PYTHON) benchmarks/bench.py --mode decode

clean: ## remove build/ (BUILD_DIR)
	rm -rf $(BUILD_DIR)

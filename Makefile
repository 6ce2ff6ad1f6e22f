# flash-attn4 developer commands. Run from the repository root; PYTHON selects the interpreter.
PYTHON ?= python
ARCH ?= sm_90a
BUILD_DIR ?= build

.PHONY: setup build compile sass-report test test-gpu demo bench bench-decode clean

# torch is installed first and explicitly: `torch==2.13.0` is the CPU wheel that pip takes from
# local disk on this project's machines. On a GPU machine, install the CUDA build of torch you want
# first and run `make setup TORCH=` to keep it.
TORCH ?= torch==2.13.0

# Pinned dependencies and the package itself (editable, with the dev extras).
setup:
	$(if $(TORCH),$(PYTHON) -m pip install "$(TORCH)")
	$(PYTHON) -m pip install -e ".[dev]"

# The Hub tree: $(BUILD_DIR)/torch-cuda/ (module files, generated _ops.py, metadata.json).
build:
	$(PYTHON) scripts/build_hub.py --build-dir $(BUILD_DIR)

# Compile the kernel set for ARCH without a GPU; an arch without kernels is an error. The module is
# run as flash_attn4.fa4_kernels.compile from torch-ext/ (this tree's, not an installed copy),
# which works from any directory.
compile:
	PYTHONPATH="$(CURDIR)/torch-ext$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m flash_attn4.fa4_kernels.compile --arch $(ARCH)

# Static facts of every kernel of ARCH's set under both embedded ptxas versions, no GPU: MMAs,
# exponentials, spills, registers, TMEM, the DSL verifier; ANCHORS=DIR adds upstream's numbers
# (../shared/sm100/compile_anchor.py --out DIR). STRICT=1 fails on a static problem (spills...).
sass-report:
	$(PYTHON) scripts/sass_report.py set --arch $(ARCH) --flavour both --verify \
	  $(if $(ANCHORS),--anchors $(ANCHORS)) $(if $(STRICT),--strict)

# Test processes (pytest-xdist): kernel compiles are most of both suites' time and run in parallel.
TEST_WORKERS ?= 2
GPU_TEST_WORKERS ?= 4

# CPU tests. pytest exits 5 when it collected no test: that is a failure here, said out loud.
test:
	$(PYTHON) -m pytest tests -m "not gpu" -q -n $(TEST_WORKERS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# GPU tests: need an sm90/sm100 GPU, skipped otherwise.
test-gpu:
	$(PYTHON) -m pytest tests -m gpu -q -n $(GPU_TEST_WORKERS)

demo:
	$(PYTHON) scripts/demo.py

bench:
	$(PYTHON) benchmarks/bench.py

bench-decode:
	$(PYTHON) benchmarks/bench.py --mode decode

clean:
	rm -rf $(BUILD_DIR)

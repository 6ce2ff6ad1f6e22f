# flash-attn4 developer commands. Run from the repository root; PYTHON selects the interpreter.
PYTHON ?= python
ARCH ?= sm_90a
BUILD_DIR ?= build

.PHONY: setup build compile test test-gpu demo bench clean

# Pinned dependencies and the package itself (editable). torch comes first and explicitly:
# `torch==2.13.0` is the CPU wheel on this project's machines (pip takes it from local disk); on a
# machine with a GPU, install the CUDA build of torch you need before running `make setup`.
setup:
	$(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev]"

# The Hub tree: $(BUILD_DIR)/torch-cuda/ (module files, generated _ops.py, metadata.json).
build:
	$(PYTHON) scripts/build_hub.py --build-dir $(BUILD_DIR)

# Compile the kernel set for ARCH without a GPU (sm_90a or sm_100a).
compile:
	$(PYTHON) -m fa4_kernels.compile --arch $(ARCH)

# CPU tests. pytest exits 5 when it collected no test: that is a failure here, said out loud.
test:
	$(PYTHON) -m pytest tests -m "not gpu" -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# GPU tests: need an sm90/sm100 GPU, skipped otherwise.
test-gpu:
	$(PYTHON) -m pytest tests -m gpu -q

demo:
	$(PYTHON) scripts/demo.py

bench:
	$(PYTHON) benchmarks/bench.py

clean:
	rm -rf $(BUILD_DIR)

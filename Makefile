# make demo · make test · make bench — each sets up what it needs on a fresh machine.
#
# The virtualenv and the Rust build cache live outside the checkout (override VENV and
# CARGO_TARGET_DIR), so a fresh clone (as CI makes) reuses the multi-GB torch install and
# the compiled dependencies instead of fetching and building them again.
#
# Clones on one machine share both, so every step that writes them, or imports the package the
# virtualenv points at, runs under $(LOCKED) (tools/shared-build-lock): two clones running
# make at the same time take turns (the second prints what it waits for) instead of removing
# each other's library mid-build or testing each other's code. A test run holds the lock from
# its build to its last test.

VENV ?= $(HOME)/.cache/tiercel/venv
export CARGO_TARGET_DIR ?= $(HOME)/.cache/tiercel/target
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.tiercel-deps
BUILD_STAMP := $(VENV)/.tiercel-build
WHEEL_STAMP := dist/.tiercel-wheel
SOURCES := $(shell find rust python -type f \( -name '*.rs' -o -name '*.py' -o -name 'Cargo.toml' \) 2>/dev/null) Cargo.toml pyproject.toml
LOCKED := $(CURDIR)/tools/shared-build-lock $(CARGO_TARGET_DIR).lock $(VENV).lock --
# Run a target's recipe in a make of its own under the lock (its build and what it runs).
LOCKED_MAKE := $(LOCKED) $(MAKE) --no-print-directory

.PHONY: all venv build wheel lint test test-rust test-python demo bench chaos peer-suites clean \
	_test-python _demo _bench _chaos _peer-suites

all: test

venv: $(DEPS_STAMP)

# Under the lock, a clone that waited for another's install finds the stamp fresh and stops.
$(DEPS_STAMP): requirements-dev.txt
	@echo "==> virtualenv in $(VENV) (first time: downloads torch, several GB; later runs skip this)"
	@$(LOCKED) $(SHELL) -ec '[ $@ -nt requirements-dev.txt ] && exit 0; \
	  test -x $(PY) || python3 -m venv $(VENV); \
	  $(PY) -m pip install --upgrade --progress-bar on pip >/dev/null; \
	  echo "$(PY) -m pip install --progress-bar on -r requirements-dev.txt"; \
	  $(PY) -m pip install --progress-bar on -r requirements-dev.txt; \
	  touch $@'

build: $(BUILD_STAMP)

# Cargo names a workspace crate's artifacts by its path inside the workspace and judges them
# fresh by the modification times of the files at that path: two clones sharing
# CARGO_TARGET_DIR share them, and a clone whose files are older than the other clone's last
# build would reuse a binary of the other clone's sources. When the build cache was last
# used from another checkout, build again: tools/shared-build-lock cleans the workspace
# crates first (dependencies stay), under the lock, never while another clone builds.
CHECKOUT_MARK := $(CARGO_TARGET_DIR)/.tiercel-checkout
ifneq ($(shell cat $(CHECKOUT_MARK) 2>/dev/null),$(CURDIR))
$(shell rm -f $(BUILD_STAMP))
endif

# `maturin develop` points the virtualenv at one checkout's python/ (tiercel.pth). When it
# points at another clone sharing this virtualenv, build again: otherwise this checkout's
# tests would import the other one's code.
ifneq ($(shell cat $(VENV)/lib/python*/site-packages/tiercel.pth 2>/dev/null),$(CURDIR)/python)
$(shell rm -f $(BUILD_STAMP))
endif

$(BUILD_STAMP): $(DEPS_STAMP) $(SOURCES)
	@echo "==> building the Rust core and the tiercel package into $(VENV)"
	$(LOCKED) env VIRTUAL_ENV=$(VENV) PATH=$(VENV)/bin:$$PATH maturin develop --release --quiet
	@touch $@

# The wheel users install: abi3 (one wheel for CPython >= 3.11), linked by zig (the `ziglang`
# package) against glibc 2.17's symbols so it installs on manylinux2014 systems and newer,
# and stripped of the debug info the release profile keeps for profiling. Into dist/.
wheel: $(WHEEL_STAMP)

$(WHEEL_STAMP): $(DEPS_STAMP) $(SOURCES) $(wildcard python/tiercel/*.pyi) Cargo.lock README.md LICENSE
	@echo "==> wheel (abi3, manylinux2014 via zig, stripped) into dist/"
	@rm -f dist/tiercel-*.whl
	$(LOCKED) env PATH=$(VENV)/bin:$$PATH $(VENV)/bin/maturin build --release --zig --compatibility manylinux2014 --strip --out dist
	@touch $@

test-rust: $(DEPS_STAMP)
	@echo "==> cargo test (tests/servers.py starts moto, an S3 server, for the conformance suite's s3 kinds)"
	$(LOCKED) $(PY) tests/servers.py -- cargo test --release --workspace --quiet

test-python: $(DEPS_STAMP)
	@$(LOCKED_MAKE) _test-python

_test-python: build
	@echo "==> pytest"
	$(PY) -m pytest -q tests

# Linters: rustfmt and clippy on the Rust workspace, ruff and mypy on the Python code.
lint: $(DEPS_STAMP)
	@echo "==> lint (cargo fmt --check, cargo clippy -D warnings, ruff, mypy)"
	cargo fmt --all --check
	$(LOCKED) cargo clippy --release --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests bench examples suites
	$(VENV)/bin/mypy

test: lint test-rust test-python

# The demo's time limit scales with its work (--steps, --world); on a slow machine raise it:
# make demo DEMO_ARGS="--timeout 1800" (python examples/torch_demo.py --help: all options).
demo: $(DEPS_STAMP)
	@$(LOCKED_MAKE) _demo

_demo: build
	$(PY) examples/torch_demo.py $(DEMO_ARGS)

# The long chaos campaign (docs/reliability.md): >= 1,000 kills over memory+fs, memory+s3
# (multipart) and the 2-host peer tier, a 1,500-bit manifest sweep, 60 s per fuzz target.
# `make test` runs the short one (~100 kills, 2 s per fuzz target).
chaos: $(DEPS_STAMP)
	@$(LOCKED_MAKE) _chaos

_chaos: build
	TIERCEL_CHAOS_KILLS=700 TIERCEL_CHAOS_PEER_KILLS=25 TIERCEL_SWEEP_FLIPS=1500 $(PY) -m pytest -q -s tests/chaos
	TIERCEL_FUZZ_SECS=60 cargo test --release -p tiercel-core --lib fuzz -- --nocapture
	TIERCEL_FUZZ_SECS=60 $(PY) -m pytest -q -s tests/test_tree_fuzz.py

BENCH_STAMP := $(VENV)/.tiercel-bench-deps

# The benchmarks' own packages (requirements-bench.txt: matplotlib for the plots, ...).
$(BENCH_STAMP): $(DEPS_STAMP) requirements-bench.txt
	@$(LOCKED) $(SHELL) -ec '[ $@ -nt requirements-bench.txt ] && exit 0; \
	  echo "$(PY) -m pip install -r requirements-bench.txt"; \
	  $(PY) -m pip install --progress-bar on -r requirements-bench.txt; \
	  touch $@'

# The benchmarks of docs/performance.md (methods: docs/benchmarks.md), each against its physical limit and the framework's
# own checkpointer in the same run. Run them on an otherwise idle machine.
bench: $(BENCH_STAMP)
	@$(LOCKED_MAKE) _bench

_bench: build
	$(PY) bench/save_restore.py
	$(PY) bench/peer.py
	$(PY) bench/deepspeed.py
	$(PY) bench/dcp.py
	$(PY) bench/orbax.py
	$(PY) bench/interleave.py
	$(PY) bench/broadcast.py
	$(PY) bench/scale.py
	$(PY) bench/scale_real.py
	$(PY) bench/goodput.py
	$(PY) bench/bytes.py

# The frameworks' own checkpoint tests (DeepSpeed, Orbax, DCP) with tiercel in place of their
# stock backends, pass counts next to the stock ones: docs/peer-suites.md. Not part of `make
# test` (tens of minutes). Fetches the test files from GitHub once; SUITES_ARGS="--suite dcp".
peer-suites: $(DEPS_STAMP)
	@$(LOCKED_MAKE) _peer-suites

_peer-suites: build
	$(PY) suites/run.py $(SUITES_ARGS)

clean:
	rm -rf $(BUILD_STAMP) $(WHEEL_STAMP) python/tiercel/_core*.so

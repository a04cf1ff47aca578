# Two commands on a fresh machine:
#   make run    create .venv (first use), prepare the default data with vision (first use; cached), run the tiny
#               CPU native-vs-CPT comparison (configs/native_vs_cpt.py) and print where its report is
#   make test   create .venv (if missing), run the whole test suite
# plus `make test-fast` (the tests not marked slow or network: a few minutes, for the edit-test loop)
# and one to train a single config: make train [CONFIG=configs/tiny_lm.py WORKDIR=workdirs/tiny_lm]
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny_lm.py
WORKDIR ?= workdirs/tiny_lm
DATA ?= data
SWEEP ?= workdirs/native_vs_cpt
PYTEST_ARGS ?=

# jax >= 0.11 needs Python >= 3.12: take the first one found on PATH or under pyenv.
define find_python
for c in python3.13 python3.12 python3 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null) \
         /usr/local/bin/python3.12 /usr/bin/python3.12; do \
  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
    echo $$c; exit 0; fi; \
done; echo "no Python >= 3.12 found (jax >= 0.11 needs it); install one or put it on PATH" >&2; exit 1
endef

$(VENV)/.installed: requirements.lock setup.py
	@set -e; PYTHON=$$($(find_python)); echo "creating $(VENV) with $$PYTHON ($$($$PYTHON --version))"; \
	$$PYTHON -m venv $(VENV); \
	$(PY) -m pip install -q -r requirements.lock; \
	$(PY) -m pip install -q --no-deps -e .; \
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) -m m3_jax.data $(DATA) --vision
	$(PY) -m experiments.native_vs_cpt --size=cpu --data_dir=$(DATA) --sweep_dir=$(SWEEP)
	@echo "report: $(SWEEP)/report.md (plots: $(SWEEP)/*.png, numbers: $(SWEEP)/results.json, runs: $(SWEEP)/*_s0/)"

train: venv
	$(PY) -m m3_jax.main --config=$(CONFIG) --workdir=$(WORKDIR)
	$(PY) -m experiments.plot_run $(WORKDIR)
	@echo "results: $(WORKDIR)/metrics.jsonl, $(WORKDIR)/plots.png, $(WORKDIR)/checkpoints/, TensorBoard events in $(WORKDIR)/tb/"

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -m "not slow and not network" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) workdirs

.PHONY: venv run train test test-fast clean

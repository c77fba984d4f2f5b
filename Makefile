# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the easymats demo (no download, no services)
#   make test   - create .venv, install everything, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# The constraints file pins the CPU build of torch for development and CI only.
PIP_INSTALL = $(PY) -m pip install -q -c constraints-dev.txt

.PHONY: venv demo test test-gpu clean

$(VENV)/.installed: pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[runtime,gpu,report,dashboards,test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/easymats demo

test: venv
	$(PY) -m pytest -q

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info

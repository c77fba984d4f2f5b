# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the easymats demo (no download, no services)
#   make test   - create .venv, install everything, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# The constraints file pins the CPU build of torch for development and CI only.
PIP_INSTALL = $(PY) -m pip install -q -c constraints-dev.txt

.PHONY: venv demo test test-gpu system-deps clean

# The alerting tests run the real Prometheus, promtool and Alertmanager from Debian's packages;
# the Kubernetes tests render deploy/kubernetes with `kubectl kustomize` (Debian's kubernetes-client
# when no kubectl is installed).
SYSTEM_TOOLS = prometheus promtool prometheus-alertmanager
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(VENV)/.installed: pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[runtime,gpu,report,dashboards,test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/easymats demo

system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages prometheus prometheus-alertmanager (missing:$$missing)"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends prometheus prometheus-alertmanager \
	  || { echo "could not install them: apt-get install prometheus prometheus-alertmanager, then make test"; exit 1; }; \
	fi
	@if ! command -v kubectl >/dev/null; then \
	  echo "installing Debian package kubernetes-client (kubectl, for kubectl kustomize)"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends kubernetes-client \
	  || { echo "could not install kubectl: apt-get install kubernetes-client (or any kubectl >= 1.14), then make test"; exit 1; }; \
	fi

test: venv system-deps
	$(PY) -m pytest -q

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info

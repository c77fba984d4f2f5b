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
# the Kubernetes tests render deploy/kubernetes with `kubectl kustomize` (Debian's kubernetes-client);
# the fault-injection tests (marker `fault`) drive the real logrotate and shift the wall clock of
# an agent with libfaketime, and read listen backlogs with ss. TOOL:PACKAGE pairs.
SYSTEM_DEPS = prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
              logrotate:logrotate faketime:faketime ss:iproute2 kubectl:kubernetes-client
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
	@missing=""; for pair in $(SYSTEM_DEPS); do tool=$${pair%%:*}; pkg=$${pair#*:}; \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$tool >/dev/null || case " $$missing " in *" $$pkg "*) ;; *) missing="$$missing $$pkg";; esac; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$missing \
	  || { echo "could not install them: apt-get install$$missing, then make test"; exit 1; }; \
	fi

test: venv system-deps
	$(PY) -m pytest -q

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info

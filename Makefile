# make demo / make test do all set-up on a fresh machine (Debian 12, root, Python 3.11):
# virtualenv, Debian's docker.io + dockerd when no daemon answers, the CPU Triton image and the
# HAProxy image built on it (stoker image builds both, each only when its recipe changed).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
IMAGE  ?= stoker/triton-cpu:2.51.0-cpu
export STOKER_HOME ?= $(HOME)/.stoker

.PHONY: setup venv venv-dev docker triton-image image demo test test-unit test-fast test-services down clean stack stack-down deploy-flows

# Three things at once: the venv's packages (waits on PyPI), the Docker engine (Debian's mirror), then the CPU Triton
# image (debootstrap and a pip of its own) as soon as the engine answers: the image needs only a bare interpreter
# with pip, not the venv's packages. Then `stoker image` finds it current and builds the HAProxy image on it.
setup:
	@$(MAKE) --no-print-directory -j3 venv docker triton-image
	@$(MAKE) --no-print-directory image

# What the demo and the pipeline need: the orchestrator, the heavy steps' packages, the local services.
venv: $(VENV)/.installed

# What the tests need on top: pytest and its plugins, the openai client, selenium, mkdocs, import-linter, ruff; and the
# HTTPRoute validator's npm packages (infra/kubernetes/package-lock.json; stoker/kubernetes/validate.py runs it).
NODE_DEPS := infra/kubernetes/node_modules/.installed
venv-dev: $(VENV)/.installed-dev $(NODE_DEPS)

# The bare interpreter: build.sh asks its pip for this machine's package index (`pip config list`).
$(VENV)/.pip:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	touch $@

# torch==2.13.0 resolves to the local CPU wheel (pip's find-links); never let it float to a CUDA build.
# Then everything is compiled once, on every core: where PYTHONDONTWRITEBYTECODE is set (these machines set it) a
# module without a .pyc is compiled again by every process that imports it (about 0.5 CPU-s for a flow's own
# modules; a test run starts hundreds). pip would compile what it installs one file at a time, 80 of its 135 s
# on 2 cores, and never compiles an editable project; compileall -j 0 does both in about 45 s. Packages' own test
# suites (pandas/tests, sympy's, scipy's …: 13 % of the source, 18 CPU-s to compile) are never imported, so they
# are left out (-x). compileall's status is ignored, as pip ignores it: some wheels ship files for newer Pythons
# (torch's py312_intrinsics.py), and a file left uncompiled is only compiled at import. Python checks each .pyc
# against its source, so an edit after this is compiled afresh, never served stale.
# xgrammar and its FFI layer without dependencies: its `triton` requirement is a GPU kernel compiler it never uses
# on CPU (infra/image/rootfs-setup.sh says the same for the image; both read infra/image/versions.env).
$(VENV)/.installed: pyproject.toml infra/image/versions.env $(VENV)/.pip
	$(PY) -m pip install -q --no-compile -e '.[heavy,stack]'
	. infra/image/versions.env && $(PY) -m pip install -q --no-compile --no-deps \
	  "xgrammar==$$XGRAMMAR_VERSION" "apache-tvm-ffi==$$APACHE_TVM_FFI_VERSION"
	$(PY) -m compileall -q -j 0 -x '/tests/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	  stoker flows tasks > /dev/null || true
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[heavy,stack,dev]'
	touch $@

# npm ci again only when the pin or the lock changes: once installed, nothing here needs the network.
$(NODE_DEPS): infra/kubernetes/package.json infra/kubernetes/package-lock.json
	bash infra/kubernetes/install.sh
	touch $@

docker:
	bash infra/dockerd.sh

# The CPU Triton image, built only when its recipe digest (label ai.stoker.recipe) differs from infra/image's files.
triton-image: $(VENV)/.pip docker
	@bash infra/system-deps.sh
	@want=$$(bash infra/image/build.sh --print-recipe); \
	have=$$(docker image inspect -f '{{index .Config.Labels "ai.stoker.recipe"}}' $(IMAGE) 2>/dev/null || true); \
	if [ "$$want" = "$$have" ]; then echo "image $(IMAGE) is up to date"; \
	else STOKER_PYTHON=$(PY) bash infra/image/build.sh $(IMAGE); fi

image: venv triton-image
	$(VENV)/bin/stoker image --name $(IMAGE)

demo: setup
	$(VENV)/bin/stoker demo

# `make test` is both tiers, fast first (a broken edit fails in a minute), each printing `tier NAME: N s`
# (benchmarks/suite.py reads them). --durations=40: the slowest tests are visible in every run.
SERVICE_MARKERS := docker or triton or s3 or hub or prefect or slow
TEST_WORKERS ?= 4
test: setup venv-dev
	bash infra/test-deps.sh
	@$(MAKE) --no-print-directory test-fast
	@$(MAKE) --no-print-directory test-services

test-unit: venv-dev
	$(PY) -m pytest -q tests/unit

# The fast tier: every test without a service marker, about a minute; what a developer runs on every edit.
# tests/tiers.py keeps it honest: a fast test that starts a service or a container, or requests a service
# fixture, errors naming itself.
test-fast: venv-dev
	@t0=$$(date +%s); $(PY) -m pytest -q --durations=10 -m "not ($(SERVICE_MARKERS))"; rc=$$?; \
	echo "tier fast: $$(( $$(date +%s) - t0 )) s"; exit $$rc

# The service tier: real Docker, Triton, S3, Hub mirror and Prefect servers. TEST_WORKERS processes
# (pytest-xdist), one test file per process at a time, so a file's module fixtures start once, in the order
# tests/conftest.py sorts them (longest first; xdist's own reorder, by test count, would start them last); most of this tier
# waits on servers and containers, so 4 processes on 2 cores keep both cores busy (benchmarks/results/suite.json).
# Work the tier would repeat dozens of times is done once: every new Prefect home starts from one migrated database
# (stoker/stack/prefect_home.py), each tiny model (architecture, seed) is generated once (stoker/workers/tinymodel.py)
# and each distinct quantization request run once (stoker/workers/quantize.py; test_quantize runs its own).
test-services: venv-dev
	@t0=$$(date +%s); tpl=$$($(PY) -m stoker.stack.prefect_home) || exit 1; tiny=$$(mktemp -d); \
	STOKER_PREFECT_DB_TEMPLATE=$$tpl STOKER_TINY_MODEL_CACHE=$$tiny STOKER_QUANTIZE_MEMO=$$tiny/quantize \
	  $(PY) -m pytest -q --durations=40 \
	  -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "$(SERVICE_MARKERS)"; \
	rc=$$?; rm -rf $$tiny; echo "tier services: $$(( $$(date +%s) - t0 )) s"; exit $$rc

down:
	$(VENV)/bin/stoker down

# The self-hosted Prefect stack (PostgreSQL 15 from Debian, basic auth, workers), the local Hub mirror and S3 the
# deployed flows read, the S3 credentials block, then deploy-flows.
stack: setup
	bash infra/prefect/stack.sh

stack-down:
	bash infra/prefect/stack.sh down

# deployments/platform.yaml (pools, GPU limits, automations), then `prefect deploy --all` on prefect.yaml.
deploy-flows: venv
	$(VENV)/bin/stoker deploy-flows

clean: down
	rm -rf $(VENV)

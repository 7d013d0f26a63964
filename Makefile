# The two commands of the README: `make demo` and `make test`. Both set up .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
BRIDGE ?= 0.6.2

.PHONY: setup demo test unit functional functional-tp4 e2e device-rehearsal test-bridge-0.5.1

setup:
	bash scripts/setup_env.sh --bridge $(BRIDGE)

demo: setup
	$(VENV)/bin/mbx demo

# Unit and e2e tests are independent of each other: pytest-xdist spreads them over TEST_WORKERS processes
# (auto: one per CPU core; 0 runs them in this process). Tests that must not overlap share an xdist_group.
# --durations lists the slowest tests at the end of each suite's log.
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist loadgroup
DURATIONS = --durations=15

unit:
	$(PY) -m pytest tests/unit -q -p no:cacheprovider $(XDIST) $(DURATIONS)

functional:
	MBX_DIST_TIMEOUT_S=$${MBX_DIST_TIMEOUT_S:-180} $(PY) -m torch.distributed.run --standalone --nproc_per_node=2 \
		-m pytest tests/functional -q -p no:cacheprovider $(DURATIONS)

# The accuracy claim at TP=4 (4 gloo ranks on the CPU).
functional-tp4:
	MBX_DIST_TIMEOUT_S=$${MBX_DIST_TIMEOUT_S:-180} $(PY) -m torch.distributed.run --standalone --nproc_per_node=4 \
		-m pytest tests/functional/test_lora_input_accuracy.py -q -p no:cacheprovider

e2e:
	$(PY) -m pytest tests/e2e -q -p no:cacheprovider $(XDIST) $(DURATIONS)

# Each suite in turn, its time printed; the first that fails stops the run.
test: setup
	@for suite in unit functional functional-tp4 e2e; do \
		began=$$(date +%s); \
		$(MAKE) --no-print-directory $$suite || exit $$?; \
		echo "make test: $$suite took $$(( $$(date +%s) - began )) s"; \
	done

# The device check on a CPU (megatron_bridge_ext/device_check/rehearsal.py): torch-only virtualenv, the carried
# wheel set, python -m megatron_bridge_ext.device_check --dry-run.
device-rehearsal: setup
	bash scripts/device_rehearsal.sh

# The backport check: the functional tests (our LoRA and its upstream flag included) on Bridge 0.5.1.
test-bridge-0.5.1:
	$(MAKE) --no-print-directory setup BRIDGE=0.5.1
	$(MAKE) --no-print-directory functional VENV=.venv-bridge0.5.1

# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STATE  ?= ./var
# Compile llama.cpp with both cores; pip caches the built wheel afterwards.
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: run test check docs unit bench clean system-deps device-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[default-model]'
	touch $@

$(VENV)/.test-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install --quiet -e '.[default-model,gemma,test]'
	touch $@

# `make run` serves the box whose settings are $(STATE)/config.toml (written once, then
# yours to edit); `. $(STATE)/env` in another shell puts this checkout's `edge-agent` on the
# PATH and points every command (keys, doctor, ledger, models) at that same file.
run: $(VENV)/.run-deps $(STATE)/config.toml $(STATE)/env
	$(BIN)/edge-agent serve --config $(STATE)/config.toml

$(STATE)/config.toml:
	mkdir -p $(STATE)
	printf '%s\n' \
		'# The box `make run` serves. Edit it, then restart `make run`; `. $(STATE)/env`' \
		'# points every other `edge-agent` command at this file (EDGE_AGENT_CONFIG).' \
		'state_dir = "$(abspath $(STATE))"' \
		'' \
		'# One app, so that `edge-agent keys create --tenant app` works at once. Until the' \
		'# first key exists every request is served without one; after it, each needs one.' \
		'[tenants.app]' \
		'models = ["*"]' > $@

$(STATE)/env:
	mkdir -p $(STATE)
	printf '%s\n' \
		'# `. $(STATE)/env`: this checkout'"'"'s edge-agent, on the box `make run` serves.' \
		'export PATH="$(abspath $(BIN)):$$PATH"' \
		'export EDGE_AGENT_CONFIG="$(abspath $(STATE))/config.toml"' > $@

check: $(VENV)/.test-deps
	$(BIN)/ruff check edge_agent tests tools
	$(BIN)/mypy edge_agent
	$(BIN)/lint-imports

# The fleet tests start their own Mosquitto and PostgreSQL from the installed binaries; the
# unit tests read systemd/ with systemd-analyze (systemd need not be running: it only reads);
# tests/test_systemd_box.py boots a minimal Debian root (debootstrap, cached in
# /var/cache/edge-agent-tests) with systemd-nspawn and provisions it with the role.
system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto"; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		|| missing="$$missing postgresql"; \
	command -v systemd-analyze >/dev/null 2>&1 || missing="$$missing systemd"; \
	command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing="$$missing debootstrap"; \
	command -v systemd-nspawn >/dev/null 2>&1 || missing="$$missing systemd-container"; \
	command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing="$$missing iproute2"; \
	command -v objdump >/dev/null 2>&1 || missing="$$missing binutils"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Debian packages)"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The manual (docs/, mkdocs.yml) as a site in site/. --strict: a broken link or anchor, or a
# page left out of the nav, fails the build, and so `make test` and CI.
docs: $(VENV)/.test-deps
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Two workers, a module at a time each, the provisioning modules first (tests/conftest.py);
# then the schemathesis module on its own: it names each operation's test alike, and xdist
# hands tests out by name. `make test WORKERS=0` runs everything in this process, in order.
WORKERS ?= 2
FUZZ_MODULE = tests/test_fuzz_schemathesis.py

test: check docs system-deps
ifeq ($(WORKERS),0)
	$(BIN)/pytest --durations=30
else
	$(BIN)/pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder \
		--ignore=$(FUZZ_MODULE) --durations=30
	$(BIN)/pytest $(FUZZ_MODULE) --durations=5
endif

unit: $(VENV)/.test-deps
	$(BIN)/pytest -m "not integration"

$(VENV)/.bench-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install --quiet -e '.[default-model,bench]'
	touch $@

bench: $(VENV)/.bench-deps
	$(BIN)/edge-agent bench --state-dir $(STATE)

# On a machine with an NVIDIA GPU: llama.cpp built with CUDA for it, the GPU tests and the
# client-side bench against a CUDA llama-server (tools/device_check.sh says what); elsewhere
# it says there is no GPU and succeeds.
device-check:
	bash tools/device_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .device-build device-check

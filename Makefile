# Laminar: build, run and test on a fresh Debian 12 machine with nothing installed by hand.
# `make run` and `make test` install what they need (Debian packages, venv, BPF objects).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUILD := build
APT_PKGS := clang llvm libbpf-dev bpftool iproute2 earlyoom stress-ng iperf3 tcpdump systemd-container gdb \
  slurmctld slurmd slurm-client munge libslurm-dev
BPF_OUT := agent/laminar/bpf/objects
BPF_SRC := $(wildcard bpf/*.bpf.c)
BPF_OBJ := $(patsubst bpf/%.bpf.c,$(BPF_OUT)/%.bpf.o,$(BPF_SRC))
PREFIX ?= /usr/local
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: all setup apt venv bpf spank run test unit kernel cluster gpu lint bench install uninstall clean
all: setup

setup: apt venv bpf spank

# Debian packages: install only what is missing, so a warm machine does not touch apt.
apt: $(BUILD)/.apt-stamp
$(BUILD)/.apt-stamp: Makefile
	@mkdir -p $(BUILD)
	@missing=""; for p in $(APT_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
	@touch $@

venv: $(BIN)/.venv-stamp
$(BIN)/.venv-stamp: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

$(BUILD)/vmlinux.h: | apt
	@mkdir -p $(BUILD)
	bpftool btf dump file /sys/kernel/btf/vmlinux format c > $@.tmp && mv $@.tmp $@

bpf: $(BPF_OBJ)
$(BPF_OUT)/%.bpf.o: bpf/%.bpf.c bpf/laminar.h $(BUILD)/vmlinux.h | apt
	@mkdir -p $(BPF_OUT)
	clang -O2 -g -Wall -Werror -target bpf -D__TARGET_ARCH_x86 -I$(BUILD) -Ibpf -c $< -o $@

# The SPANK plugin (docs/slurm.md), built against Debian's Slurm headers (libslurm-dev).
SPANK_SO := $(BUILD)/spank/laminar_spank.so
spank: $(SPANK_SO)
$(SPANK_SO): spank/laminar_spank.c | apt
	@mkdir -p $(BUILD)/spank
	gcc -O2 -g -Wall -Wextra -Werror -fPIC -shared -o $@ $<

# Run the agent in the foreground on this node (root). With no CONFIG it is a one-node zone
# on the default route's interface; its data plane passes all traffic until told otherwise.
run: setup
	$(BIN)/laminard $(if $(CONFIG),--config $(CONFIG),)

lint: venv
	$(BIN)/ruff check agent ctl tests bench
	$(BIN)/mypy

# The whole suite. Kernel and cluster tests need root; in CI (CI=true) a skipped one fails the run.
# Three runs, each always run; the suite fails if any did (5, nothing collected under a -k, is not
# a failure):
# 1. unit and cluster tests, two files at a time (TEST_WORKERS; each cluster test tags its bridge,
#    namespaces, pins and cgroup root with a name of its own), but for those marked `serial`;
# 2. kernel tests, two files at a time, but for those marked `serial`: they too build namespaces,
#    veths, pins, cgroups and users of their own;
# 3. the `serial` kernel and cluster tests and the GPU tests, one at a time: memory storms whose
#    pressure the whole machine feels (the agents of other tests would see it), the kernel's next pid steered,
#    systemd booted in a container, a connection flood.
TEST_WORKERS ?= 2
test: setup lint
	@rc=0; \
	$(BIN)/pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS) tests/unit tests/cluster \
	  || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(BIN)/pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile -m "not serial and not gpu" $(PYTEST_ARGS) \
	  tests/kernel tests/gpu || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(BIN)/pytest -ra --durations=30 -m "serial or gpu" $(PYTEST_ARGS) tests/kernel tests/cluster tests/gpu \
	  || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc

unit: setup
	$(BIN)/pytest -ra $(PYTEST_ARGS) tests/unit

kernel: setup
	$(BIN)/pytest -ra $(PYTEST_ARGS) tests/kernel

cluster: setup
	$(BIN)/pytest -ra $(PYTEST_ARGS) tests/cluster

# On a node with a GPU and its driver (NVML): discovery, per-process memory, GPU jobs, the agent.
# They skip, each with its reason, where there is none (this is part of `make test` too).
gpu: setup
	$(BIN)/pytest -ra -m gpu $(PYTEST_ARGS) tests/gpu

bench: setup
	@mkdir -p bench/results
	@for b in bench/*.py; do n=$$(basename $$b .py); echo "== $$n"; \
	  $(BIN)/python $$b --json bench/results/$$n.json --plot bench/results/$$n.png || exit 1; done

install: setup
	install -d $(DESTDIR)/etc/laminar $(DESTDIR)/etc/systemd/system $(DESTDIR)/usr/lib/tmpfiles.d
	test -f $(DESTDIR)/etc/laminar/laminard.toml || install -m 0644 systemd/laminard.toml $(DESTDIR)/etc/laminar/laminard.toml
	sed "s#@BINDIR@#$(CURDIR)/$(BIN)#g" systemd/laminard.service > $(DESTDIR)/etc/systemd/system/laminard.service
	install -m 0644 systemd/laminar.tmpfiles $(DESTDIR)/usr/lib/tmpfiles.d/laminar.conf
	# bytecode for the agent and the CLI, so a unit that cannot write the checkout (or runs with
	# PYTHONDONTWRITEBYTECODE) does not compile every module at each start (~0.25 s, ~12 MB peak)
	$(BIN)/python -m compileall -q agent/laminar ctl/laminarctl
	-systemctl daemon-reload 2>/dev/null

uninstall:
	-systemctl disable --now laminard 2>/dev/null
	-test -x $(BIN)/laminarctl && $(BIN)/laminarctl bpf unload --force
	rm -f $(DESTDIR)/etc/systemd/system/laminard.service $(DESTDIR)/usr/lib/tmpfiles.d/laminar.conf
	-systemctl daemon-reload 2>/dev/null

clean:
	rm -rf $(BUILD) $(BPF_OUT) .pytest_cache .mypy_cache .ruff_cache

# `make demo`: plain decoding vs EAGLE-3 chain and tree on the bundled kimi-mini pair.
# `make test`: the test suite.
# Each creates .venv if missing and installs what it needs once (stamp files; re-run after
# pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: demo test test-heavy venv clean-venv

venv: $(VPY)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-demo: pyproject.toml | $(VPY)
	$(VPY) -m pip install -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml | $(VPY)
	$(VPY) -m pip install -e '.[test]'
	touch $@

# The demo runs bfloat16 with batch-invariant numerics (scripts/demo.py's defaults); DEMO_FLAGS adds
# flags, e.g. make demo DEMO_FLAGS="--json=benchmarks/kimi-mini-demo.json --overwrite" to record it.
DEMO_FLAGS ?=
demo: $(VENV)/.stamp-demo
	$(VPY) scripts/demo.py --target=checkpoints/kimi-mini --draft=checkpoints/kimi-mini-eagle3 \
		--prompts=checkpoints/demo_prompts.txt --max_tokens=128 $(DEMO_FLAGS)

# The sharding tests need 8 (fake) CPU devices. The tests compile far more than they run, so LLVM
# optimizes the CPU programs at -O0 (same results, about a fifth less time), and two pytest
# workers compile side by side (XLA compiles a program on one thread); a test file stays on one
# worker, so its module fixtures are built once.
PYTEST := XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" $(VPY) -m pytest -q -n 2 --dist loadfile
test: $(VENV)/.stamp-test
	$(PYTEST)

# The tests marked heavy (tests/conftest.py's HEAVY): CI runs them after `make test`.
test-heavy: $(VENV)/.stamp-test
	$(PYTEST) -m "heavy and not slow"

clean-venv:
	rm -rf $(VENV)

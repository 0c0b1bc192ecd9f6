# `make demo`: generate from the bundled stories260K model. `make test`: the test suite.
# Each creates .venv if missing and installs what it needs once (stamp files; re-run after
# pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: demo test venv clean-venv

venv: $(VPY)

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-demo: pyproject.toml | $(VPY)
	$(VPY) -m pip install -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml | $(VPY)
	$(VPY) -m pip install -e '.[test]'
	touch $@

demo: $(VENV)/.stamp-demo
	$(VPY) scripts/generate.py --model=checkpoints/stories260K --max_tokens=200

# The sharding tests need 8 (fake) CPU devices.
test: $(VENV)/.stamp-test
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(VPY) -m pytest -q

clean-venv:
	rm -rf $(VENV)

# The two commands of the README: `make up` serves the embedded model; `make test` runs
# the whole test suite. Both install what they need first (scripts/bootstrap.sh).
VENV ?= .venv
ARGS ?=

.PHONY: up test test-quick bootstrap wire

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/llm-mesh up $(ARGS)

test: bootstrap
	$(VENV)/bin/python -m pytest -q $(ARGS)

# Skips tests that load the model or start the mesh.
test-quick: bootstrap
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

# Regenerates services/common/wire from proto/.
wire: bootstrap
	$(VENV)/bin/python -m services.common.wire_codegen

# The two commands of the README: `make up` serves the embedded model; `make test` runs
# the whole test suite. Both install what they need first (scripts/bootstrap.sh).
VENV ?= .venv
ARGS ?=

.PHONY: up test test-quick test-compose bootstrap wire

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/llm-mesh up $(ARGS)

test: bootstrap
	$(VENV)/bin/python -m pytest -q $(ARGS)

# Skips tests that load the model or start the mesh.
test-quick: bootstrap
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

# compose/ for real: builds the image, brings the mesh up under Docker Compose, checks it
# serves and survives a worker restart, removes it. Needs a Docker engine; not in `test`.
test-compose: bootstrap
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/compose/check_compose_stack.py $(ARGS)

# Regenerates services/common/wire from proto/.
wire: bootstrap
	$(VENV)/bin/python -m services.common.wire_codegen

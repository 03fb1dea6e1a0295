"""`python -m llm_mesh.bench serve ...`, the same as `llm-mesh bench serve ...`."""

import sys

from llm_mesh.bench.cli import main

sys.exit(main())

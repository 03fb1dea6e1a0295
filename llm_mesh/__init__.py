"""The `llm-mesh` command: start the whole mesh, run one service, benchmark a server."""

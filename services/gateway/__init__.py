"""The gateway: the OpenAI-compatible HTTP API in front of the mesh."""

"""LLM Mesh services. Each subpackage is one service and imports only services.common."""

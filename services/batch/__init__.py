"""The batch-job runner (`llm-mesh serve batch`): takes jobs from JetStream and runs their
lines through the shared request path (services/common/frontend). See docs/batch.md.
"""

"""The batch plane shared by the gateway's /v1/files and /v1/batches and the batch runner:
job files in the JetStream Object Store, job records and per-line results in JetStream KV,
jobs on a JetStream work-queue stream. See docs/batch.md.
"""

"""The batch-job runner (`llm-mesh serve batch`) and the batch plane it shares with the
gateway's /v1/files and /v1/batches: job files in the JetStream Object Store, job records
and per-line results in JetStream KV, jobs on a JetStream work-queue stream. See docs/batch.md.
"""

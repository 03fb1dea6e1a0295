"""The scheduler's side of the KV connector, after vLLM's KVConnectorBase_V1 (scheduler role):
which prompt blocks to load from the kvstore and which to save to it (connector.py), the
transfers a step carries and the worker's reports (metadata.py), and a request waiting while
the worker loads its blocks (loading.py, owned by the Scheduler)."""

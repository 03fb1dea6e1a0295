"""The scheduler service's KV connector plumbing around the pure core/kv_connector/: the
kvstore lookup at admission (lookup.py), its StepInput/StepOutput columns (codec.py) and the
service's calls into both (connector_runtime.py)."""

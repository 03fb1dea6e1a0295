"""The client side of the engines, as vLLM's `v1/engine` (AsyncLLM, EngineCoreClient): one
HTTP request's run (request_run.py: route, encode, submit every choice, hand out deltas),
the mesh client that talks to tokenizers and schedulers over NATS (mesh_client.py), each
choice it tracks (generation.py), moving one whose engine or tokenizer is lost
(migration.py), the gateway's view of the mesh from heartbeats (mesh_view.py), prefill /
decode disaggregation (disaggregation.py) and per-request timings (request_stats.py).
"""

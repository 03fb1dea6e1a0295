"""The worker side of the KV connector: moves blocks between the KV tensors and the kvstore
(connector.py) on a transfer thread (transfer.py)."""

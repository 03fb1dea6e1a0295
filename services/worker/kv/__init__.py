"""KV on the worker: the paged KV tensors and their size (kv_cache.py), faulted in ahead of
use on CPU (kv_prefault.py), and the worker side of the KV connector, which moves blocks
between those tensors and the kvstore (connector.py) on a transfer thread (transfer.py)."""

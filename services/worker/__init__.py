"""The worker: model weights, KV tensors, the model runner and its sampler (one per device)."""

"""kvstore service: KV cache blocks beyond one worker (CPU and disk tiers, a Redis index,
a gRPC data plane)."""

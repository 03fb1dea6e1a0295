"""Tensor parallelism inside one engine (--tensor-parallel-size N): the worker is rank 0 and
starts N-1 follower ranks as processes over torch.distributed (gloo on CPU, NCCL on GPUs).

- sharding.py: which heads, MLP columns and vocabulary rows each rank holds, and a weight
  source that reads only those (Megatron-style column / row splits).
- layers.py: the collectives the sharded model needs: an all-reduce after each row-parallel
  linear (o_proj, down_proj), vocab-parallel embedding and LM head.
- group.py: the process group, and each rank's share of the CPU cores.
- ranks.py: rank 0's model proxy, which mirrors every forward to the followers, and the
  followers' loop.
"""

"""The device a Triton kernel launches on.

Triton launches on the current CUDA device and its current stream, not on its arguments'
device: a tensor-parallel rank whose tensors live on cuda:1 while the current device is still
cuda:0 would run its kernels on GPU 0 against GPU 1's memory (an illegal access, or wrong
output). Every launch site in kernels/ therefore launches inside `launch_device(tensor)`.
"""

import contextlib

import torch


def launch_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """`tensor`'s CUDA device made current for the launch; nothing to switch on CPU (the
    interpreter)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()

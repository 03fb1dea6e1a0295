"""--batch-invariant: a request's tokens and logprobs are bitwise the same whatever its
batchmates, its chunking and its place in the batch (what an RL trainer comparing logprobs
needs; vLLM's VLLM_BATCH_INVARIANT on GPUs).

What varied, measured on the CPU path (benchmarks/batch_invariance.py, docs/benchmarks.md 17:
without the flag bf16 differed in 12/50 token and 43/50 logprob sequences, fp32 in 0 and 5):
- linears (bf16): a step of up to 8 rows reads the GGUF blocks (bf16 products summed in pairs),
  larger steps run oneDNN's bf16 GEMM, and oneDNN itself runs 1 row another way than 2 or
  more (down_proj, K = 1536: 9 rows in 128 differ). So every linear runs oneDNN on tiles of
  exactly LINEAR_TILE_ROWS rows (Linear.make_batch_invariant): one kernel, one order per row.
- attention: a decode is cut into KV splits sized by the step's whole decode work, and a
  query token alone in its chunk (a decode, or a prompt chunk of one token) runs the decode
  kernel while the rest of a prompt runs the prefill kernel (other products, other sums), and
  fp32 items of 1-2 tokens sum by rows, larger ones by columns. So every query token goes into
  per-KV-head prefill tiles, never split, fp32 ones by columns (attention_plan.cpp,
  attention.cpp). fp32 GGUF blocks were already invariant (one FMA chain per output).
Nothing else needed fixing (with these two, 0/50 and 0/50): norms, rotary and SiLU run row
by row, greedy argmax and the fp32 log_softmax per row.
NOTE: measured on AVX-512 with bf16 and without AMX; on an AMX CPU the tiles run the AMX
kernel (amx_linear.cpp) and the attention's AMX tiles, whose invariance is not yet measured
(tests/worker/test_batch_invariance.py checks it wherever it runs).
"""

from __future__ import annotations

from services.worker.attention.backend import AttentionBackend
from services.worker.attention.cpu_attn import CpuAttentionBackend
from services.worker.models.layers import Linear
from services.worker.models.llama import LlamaForCausalLM

LINEAR_TILE_ROWS = 16


def enable_batch_invariance(model: LlamaForCausalLM, attn: AttentionBackend) -> None:
    """Fixes the reduction orders of `model`'s linears and of its attention backend."""
    if not isinstance(attn, CpuAttentionBackend) or attn.ops is None:
        raise ValueError("--batch-invariant needs the CPU attention kernels (kernels/cpu): "
                         f"this worker runs {attn.name!r} attention")
    linears = [lin for layer in model.layers for lin in layer.linears] + [model.lm_head]
    for linear in linears:
        if type(linear) is not Linear:
            raise ValueError(f"--batch-invariant covers dense linears only, not "
                             f"{type(linear).__name__} (--quantization, quantized checkpoints)")
        linear.make_batch_invariant(LINEAR_TILE_ROWS)
    attn.batch_invariant = True

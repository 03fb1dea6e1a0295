"""The worker's settings (flags keep vLLM's names where the concept is the same)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv_data_plane import KVTLSSettings
from services.common.settings import CommonSettings, EngineSettings, setting


@dataclass
class WorkerSettings(CommonSettings, EngineSettings, KVTLSSettings):
    dtype: str = setting("float32", "Weights and activations dtype",
                         choices=("float32", "bfloat16", "float16"))
    quantization: str = setting("none", "CPU only: int8 runs every linear as W8A8 (int8 "
                                "weights per channel, activations per token; the rest stays "
                                "in --dtype)", choices=("none", "int8"))
    kv_cache_dtype: str = setting("auto", "KV cache dtype (fp8: e4m3 with scales, half the "
                                  "bytes)", choices=("auto", "fp8"))
    kv_cache_memory: int = setting(0, "Bytes of KV cache, on an accelerator too (0: "
                                   "--kv-cache-memory-fraction of available RAM on CPU, "
                                   "--gpu-memory-utilization on an accelerator)")
    kv_cache_memory_fraction: float = setting(0.25, "CPU: share of available RAM for the KV "
                                              "cache when --kv-cache-memory is 0")
    gpu_memory_utilization: float = setting(0.9, "Accelerator: share of its memory this "
                                            "worker may use (weights, activations, KV)")
    device: str = setting("auto", "Where the model runs", choices=("auto", "cpu", "cuda"))
    attention_backend: str = setting("auto", "Attention implementation (auto: triton on "
                                     "cuda, torch on cpu)", choices=("auto", "torch", "triton"))
    num_threads: int = setting(0, "CPU threads for the model (0: all cores)")
    tensor_parallel_size: int = setting(
        1, "Split the model over this many ranks (processes: gloo on CPU, NCCL on GPUs), each "
        "holding a share of the attention heads, MLP columns and vocabulary; on CPU each rank "
        "runs on its own share of the cores")
    use_gguf_blocks: bool = setting(True, "With a GGUF model in fp32 on CPU: decode steps of a "
                                    "few requests read the GGUF's quantized blocks, expanded to "
                                    "the same fp32 values on the fly (~5x fewer bytes a step)")
    enable_lora: bool = setting(False, "Serve LoRA adapters (PEFT directories) named by "
                                "requests; the gateway's --lora-modules names them")
    max_loras: int = setting(1, "With --enable-lora: adapters one step may mix (their slots "
                             "are allocated in the model)")
    max_lora_rank: int = setting(16, "With --enable-lora: the largest adapter rank accepted")
    max_cpu_loras: int = setting(0, "With --enable-lora: adapters kept in host memory, least "
                                 "recently used dropped first (0: --max-loras)")
    enable_sleep_mode: bool = setting(False, "Sleep mode (POST /sleep, /wake_up): the worker "
                                      "may release its weights and KV cache between uses, as "
                                      "an RL trainer sharing the machine asks")
    batch_invariant: bool = setting(False, "CPU kernels: each request's tokens and logprobs "
                                    "bitwise the same whatever its batchmates and chunking "
                                    "(fixed reduction orders; costs speed, docs/benchmarks.md 17)")
    encoder_cache_size: int = setting(8192, "Vision models: image embeddings kept by content "
                                      "hash, in embedding rows (least recently used dropped)")
    num_state_checkpoints: int = setting(
        0, "Hybrid (Mamba2 + attention) models: copies of a sequence's recurrent state kept at "
        "block boundaries for prefix caching, each as large as one sequence's state in every "
        "Mamba layer, beside the KV cache (0: --max-num-seqs of them)")
    grammar_cache_size: int = setting(64, "Structured outputs: compiled grammars kept (LRU), "
                                      "keyed by kind and spec text")
    # KV connector (docs/kvstore.md): the scheduler names the blocks; these bound the I/O.
    kv_load_timeout_s: float = setting(5.0, "A KV load from the kvstore that has not arrived "
                                       "by then is given up (the rest is recomputed)")
    kv_save_timeout_s: float = setting(30.0, "Longest one KV save to the kvstore may take")
    kv_save_buffer_bytes: int = setting(512 * 1024**2, "KV bytes waiting to be saved, at most; "
                                        "beyond it saves are dropped (the store is behind)")

"""The model runner, as vLLM's `v1/worker`: one step per StepInput (model_runner.py) over the
persistent batch (input_batch.py) and the step's flattened inputs (step_batch.py), loading
(model_loader.py, cpu_runtime.py), CUDA graphs (cuda_graphs.py), the step's answer
(step_output.py), the hooks through which optional features (LoRA, images, speculative
decoding, the KV connector) join a step (step_hooks.py), and the warm-up the worker service
runs before it says hello (warm_up.py).
"""

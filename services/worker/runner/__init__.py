"""The model runner, as vLLM's `v1/worker`: one step per StepInput (model_runner.py) over the
persistent batch (input_batch.py) and the step's flattened inputs (step_batch.py), loading
(model_loader.py, cpu_runtime.py), CUDA graphs (cuda_graphs.py), the step's answer
(step_output.py) and the warm-up before the worker says hello (warm_up.py).
"""

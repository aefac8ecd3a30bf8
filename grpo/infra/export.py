"""Any saved checkpoint as a Hugging Face folder that `transformers` loads, or as a PEFT adapter.

    python -m grpo.cli.export runs/NAME/checkpoints/step_000040 OUT_DIR [--model_path BASE] \\
        [--push_to_hub REPO]
    python -m grpo.cli.export runs/NAME/checkpoints/step_000040 OUT_DIR --adapter      # a LoRA run's adapters

A checkpoint (grpo/infra/checkpoint.py) holds the trained weights and the optimizer as DCP shards;
the architecture, tokenizer and chat template come from the base model the run started from:
`--model_path`, or the run's own `config.json` (two folders up from the checkpoint), which also
says whether the run trained LoRA adapters (their settings). Only the model's entries are read,
into fp32 weights on the CPU, whatever world size wrote them. A LoRA run's export is the merged
model (W + s B A, summed in fp32), or with `--adapter` a PEFT folder that `peft.PeftModel.from_pretrained`
loads. `--dtype auto` writes a full fine-tune's fp32 weights as they are, and a LoRA merge in the base
checkpoint's own dtype (as peft's merge_and_unload keeps it): for a bf16 base that drops each entry of
s B A below half a bf16 ulp of W, which `--dtype float32` keeps, at twice the bytes.
"""
import argparse
import json
import sys
from pathlib import Path

import torch


def run_config(checkpoint: Path) -> dict:
    """OUTPUT_DIR/config.json beside OUTPUT_DIR/checkpoints/step_N ({} when there is none)."""
    config = checkpoint.resolve().parents[1] / "config.json"
    if not config.exists():
        return {}
    try:
        return json.loads(config.read_text())
    except ValueError as e:
        raise SystemExit(f"error: {config}: not valid JSON ({e})") from None


def base_model_path(checkpoint: Path) -> str:
    """The run's model_path, from OUTPUT_DIR/config.json beside OUTPUT_DIR/checkpoints/step_N."""
    config = checkpoint.resolve().parents[1] / "config.json"
    if not config.exists():
        raise SystemExit(f"error: {config} not found: pass --model_path (the model the run started from)")
    path = run_config(checkpoint).get("model_path")
    if not path:
        raise SystemExit(f"error: {config}: no model_path; pass --model_path")
    return path


def load_checkpoint(checkpoint: str, model_path: str, dtype: torch.dtype = torch.float32, lora=None):
    """A Transformer built from `model_path`'s config with the checkpoint's weights; `lora`
    (grpo.models.lora.LoraSettings): the run trained adapters, read into a model that has them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from grpo.infra.checkpoint import TRAINED
    from grpo.models.lora import add_lora
    from grpo.models.model import Transformer
    path = Path(checkpoint)
    if not (path / ".metadata").exists():
        raise SystemExit(f"error: {path} is not a complete checkpoint (no .metadata): pass a "
                         "runs/NAME/checkpoints/step_NNNNNN folder")
    adapters = [k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
                if k.endswith(".lora_A")]
    if adapters and lora is None:
        raise SystemExit(f"error: {path} holds LoRA adapters, and no run config.json beside its checkpoints "
                         "folder gives their settings (use_peft, lora_r, ...): "
                         "export from the run's own folder")
    model = Transformer.from_pretrained(model_path, dtype=dtype, device="cpu")
    if lora is not None:
        add_lora(model, lora)
    state = {"model": get_model_state_dict(model, options=TRAINED)}  # the adapters only, under LoRA
    dcp.load(state, checkpoint_id=str(path))       # reads only the keys asked for: no optimizer state
    set_model_state_dict(model, state["model"], options=TRAINED)
    return model


def export_dtype(name: str, base_config: dict, lora: bool) -> torch.dtype:
    """--dtype as a torch dtype; auto: a LoRA merge in the base checkpoint's dtype (its config.json's
    dtype, or torch_dtype before transformers 5), else float32 (the trained fp32 master weights)."""
    if name == "auto":
        base = base_config.get("dtype") or base_config.get("torch_dtype") or "float32"
        name = base if lora and base in ("float32", "bfloat16", "float16") else "float32"
    return getattr(torch, name)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m grpo.cli.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a checkpoint folder: runs/NAME/checkpoints/step_NNNNNN")
    p.add_argument("out_dir", help="the Hugging Face folder to write")
    p.add_argument("--model_path", help="the base model (default: model_path in the run's config.json)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights on disk; auto: float32 for a full fine-tune, "
                        "the base's dtype for a LoRA merge")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT folder instead of the merged model")
    p.add_argument("--push_to_hub", metavar="REPO",
                   help="then upload the folder (needs huggingface_hub and a login)")
    args = p.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    run = run_config(checkpoint)
    from grpo.models.lora import save_adapter, settings_of
    lora = settings_of(argparse.Namespace(**run)) if run.get("use_peft") else None
    if args.adapter and lora is None:
        raise SystemExit(f"error: --adapter: {checkpoint} is from a run without LoRA (its config.json has no "
                         "use_peft): export the model without --adapter")
    base = args.model_path or base_model_path(checkpoint)
    model = load_checkpoint(args.checkpoint, base, lora=lora)
    if args.adapter:
        save_adapter(args.out_dir, model.state_dict(), lora, base)
    else:  # adapters merged in fp32, rounded once to the dtype on disk
        model.save_pretrained(args.out_dir, dtype=export_dtype(args.dtype, model.config, lora is not None))
    print(f"export: {checkpoint} -> {args.out_dir}" + (" (PEFT adapter)" if args.adapter else ""))
    if args.push_to_hub:
        try:
            from huggingface_hub import HfApi
            HfApi().create_repo(args.push_to_hub, exist_ok=True)
            HfApi().upload_folder(folder_path=args.out_dir, repo_id=args.push_to_hub)
        except Exception as e:  # offline, no login, no library: the export itself is done
            raise SystemExit(f"error: push to {args.push_to_hub} failed ({type(e).__name__}: {e}); "
                             f"the folder {args.out_dir} is written") from None
        print(f"pushed: https://huggingface.co/{args.push_to_hub}")
    return Path(args.out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])

"""python -m grpo.cli.export: a saved checkpoint (DCP shards) becomes a Hugging Face folder that
transformers loads, with the trained weights (equal logits to the run's own final export)."""
import pytest
import torch
import transformers
from toy import ToyEnv, make_toy_dir

from grpo.config import Config
from grpo.infra.export import main as export_main
from grpo.trainer import train

EXAMPLES = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(16)]


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_export_a_checkpoint(tmp_path, one_thread):
    base = make_toy_dir(tmp_path / "base")
    cfg = Config(model_path=base, output_dir=str(tmp_path / "run"), max_steps=2, prompts_per_step=2,
                 num_generations=4, learning_rate=3e-2, max_prompt_length=16, max_completion_length=8,
                 micro_batch_tokens=256, gen_batch=8, save_steps=2, export=True, tis_cap=0.0)
    train(cfg, ToyEnv(), EXAMPLES)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    out = export_main([str(checkpoint), str(tmp_path / "exported"), "--model_path", base])
    ids = torch.tensor([[6, 7, 8, 9, 10, 11]])
    ours = hf_logits(out, ids)
    # the run's own end-of-training export holds the same weights: step 2 is the last step
    torch.testing.assert_close(ours, hf_logits(tmp_path / "run" / "export", ids), atol=0, rtol=0)
    assert (ours - hf_logits(base, ids)).abs().max() > 1e-3, "the export should hold the trained weights"
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template


def test_export_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="not a complete checkpoint"):
        export_main([str(tmp_path), str(tmp_path / "out"), "--model_path", "x"])
    (tmp_path / "run" / "checkpoints" / "step_000001").mkdir(parents=True)
    with pytest.raises(SystemExit, match="config.json not found: pass --model_path"):
        export_main([str(tmp_path / "run" / "checkpoints" / "step_000001"), str(tmp_path / "out")])

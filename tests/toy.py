"""A toy checkpoint for trainer tests: a tiny random Llama with a 64-word vocabulary, a
word-level tokenizer and a minimal chat template, saved as a normal HF folder."""
import json

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<end>", "<system>", "<user>", "<assistant>"]
WORDS = [f"w{i}" for i in range(58)]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_toy_dir(path, seed: int = 0, layers: int = 2) -> str:
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<end>")
    fast.chat_template = TEMPLATE
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   eos_token_id=vocab["<end>"], bos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab["<end>"]]}))
    return str(path)


class ToyEnv:
    """Single-turn toy task: reward = share of completion words in a target set (w0..w7),
    about 8/58 for a random policy; GRPO should push it up within a few dozen steps."""
    stop_strings: list = []
    max_turns = 1
    observation_role = "user"
    TARGET = {f"w{i}" for i in range(8)}

    def prompt(self, example):
        return [{"role": "user", "content": example["question"]}]

    def reward(self, example, trajectory):
        words = [w for w in trajectory.text.split() if w.startswith("w")]
        return {"correct": sum(w in self.TARGET for w in words) / max(len(words), 1)}


def target_words(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """ToyEnv's reward as a TRL-style reward function (recipes/custom_task.py's --reward_funcs)."""
    words = [[w for w in c.split() if w.startswith("w")] for c in completions]
    return [sum(w in ToyEnv.TARGET for w in ws) / max(len(ws), 1) for ws in words]


def short(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """A second term, to check weights and columns reach the functions: 1 when the answer column
    arrived and the completion has at most 4 words."""
    return [float(a == "w3" and len(c.split()) <= 4) for c, a in zip(completions, answer)]

"""The models: one Transformer for Qwen2/2.5, Qwen3 and Llama (model.py) with Qwen3.5's hybrid blocks
(qwen35.py, deltanet.py), loaded from Hugging Face safetensors; LoRA (lora.py); share_prompt's attention
(prompt_attention.py); the packaged SmolLM2-135M (smollm2.py).

Its door is `grpo.models.model.Transformer.from_pretrained(path)`."""

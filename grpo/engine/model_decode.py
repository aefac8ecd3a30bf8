"""Decode through the model's own forward, for a model that grpo/engine/decode.py's DecodeWeights does not
hold: Qwen3.5's hybrid models, whose Gated DeltaNet layers have no q/k/v projections to fuse and
carry a recurrent state instead of keys (grpo/engine/hybrid_cache.py).

It stands where the sampler keeps its DecodeWeights: `refresh`, `matches`, the LM head that
grpo.engine.sampling.sample_hidden reads, and `hidden`, decode_hidden's job for one step: one token per
row through the model's blocks over the cache, to the final norm. A row that is not decoding
(finished on device, in a tool call) is fed as padding: its KV is not written and its linear
state is held, where an attention-only decode may rewrite the same key in place. No CUDA graph (the
cache's padded writes read their count back to the host): the sampler decodes eagerly.
"""
import torch
from torch import Tensor

from grpo.engine.decode import needs_head32


class ModelDecode:
    head = None  # no packed LM-head blocks (DecodeWeights' packed mode)

    def __init__(self, model):
        self.args = model.args
        self.refresh(model)

    def matches(self, model) -> bool:  # the model's own tensors, whatever their dtype or autocast
        return True

    def refresh(self, model):
        """The model's tensors as they are now (under FSDP2, those gathered for this call); the LM head
        in fp32 once per call where the logits need it (grpo/engine/decode.py's DecodeWeights.logits_head)."""
        self.model, self.lm_head = model, model.lm_head.weight
        self.head32 = self.lm_head.float() if needs_head32(self.lm_head) else None

    def logits_head(self, y: Tensor) -> tuple[Tensor, Tensor]:  # as DecodeWeights.logits_head
        return (self.lm_head, y) if self.head32 is None else (self.head32, y.to(self.lm_head.dtype))

    def hidden(self, cache, tok: Tensor, pos: Tensor, n: int, span: int, active: Tensor) -> Tensor:
        """Rows [0, n) of the cache each take token tok (n,) at position pos (n,), reading keys
        [0, span); rows not `active` (n,) leave their cache as it was. -> the final norm's output
        (n, H). What Transformer.forward runs, without its packing and LM head."""
        m = self.model
        cache.rows(slice(0, n), pos, 1, span, active[:, None])
        x = m.embed_tokens(tok[:, None])  # (n, 1, H)
        freqs = pos[:, None, None, None].float() * m.inv_freq  # (n, 1, 1, rotary_dim/2) fp32
        cos, sin = freqs.cos(), freqs.sin()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=m.autocast_bf16):
            for block in m.layers:
                x = block(x, cos, sin, None, cache)
        return m.norm(x)[:, 0]

"""The sampler's cache for a hybrid model (Qwen3.5): grpo/engine/kv_cache.py's KV cache for the attention
layers, and for each Gated DeltaNet layer (grpo/models/deltanet.py) a fixed-size state per slot in place of
keys and values: the conv window (the layer's last K-1 inputs) and the recurrent state S (Hv, Dk, Dv),
float32 as the chunked form computes it.

The state is where a row is now, not a history: a slot's state can be forked (copied) only at the
position it holds. So a prompt is forked into its n samples' slots right after its prefill
(grpo/engine/scheduler.py prefills again rather than fork a live row that has decoded past its prompt), and
continue_from prefills each cut on its own. The hook the model's layers call: the attention layers'
`update` (their layer index mapped to the KV cache's), and the linear layers' `linear_read` (the rows'
(window, state), and which tokens are real) and `linear_write`.
"""
from dataclasses import replace

import torch
from torch import Tensor

from grpo.engine.kv_cache import KVCache, to_device


class HybridCache(KVCache):
    def __init__(self, args, slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        kinds = args.layer_types
        self.attn = {l: i for i, l in enumerate(l for l, t in enumerate(kinds) if t == "full_attention")}
        self.lin = {l: i for i, l in enumerate(l for l, t in enumerate(kinds) if t == "linear_attention")}
        super().__init__(replace(args, n_layers=len(self.attn)), slots, max_seq_len, dtype, device)
        la = args.linear
        self.conv = torch.zeros(len(self.lin), slots, la.conv_kernel - 1, la.conv_dim, dtype=dtype,
                                device=device)
        # fp32 (a float64 model: float64)
        self.state = torch.zeros(len(self.lin), slots, la.v_heads, la.k_dim, la.v_dim, device=device,
                                 dtype=torch.promote_types(dtype, torch.float32))
        self.valid = None  # rows mode: (B, T) bool, the real tokens of a padded batch (None: all)

    @staticmethod
    def slot_bytes(args, max_seq_len: int, dtype: torch.dtype) -> int:
        """A slot's bytes: the attention layers' keys and values, and the linear layers' state, a fixed
        cost whatever the length (a layer: Hv * Dk * Dv fp32 floats and (K-1) * C in `dtype`)."""
        n_attn = args.layer_types.count("full_attention")
        la = args.linear
        state = (la.conv_kernel - 1) * la.conv_dim * dtype.itemsize + la.v_heads * la.k_dim * la.v_dim * 4
        attn = KVCache.slot_bytes(replace(args, n_layers=n_attn), max_seq_len, dtype)
        return attn + (args.n_layers - n_attn) * state

    def packed(self, slot: Tensor, pos: Tensor):
        super().packed(slot, pos)
        self.token_slot, self.valid = slot, None  # a document's state goes to the slot of its first token

    def rows(self, rows, start: Tensor, T: int, span: int, valid: Tensor | None = None,
             real: tuple[Tensor, Tensor] | None = None):
        super().rows(rows, start, T, span, valid, real)
        self.valid = valid

    def update(self, layer: int, k: Tensor, v: Tensor):
        return super().update(self.attn[layer], k, v)

    def linear_read(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Rows mode: the rows' conv window (B, K-1, C), state (B, Hv, Dk, Dv) and valid (B, T) or None."""
        i, rows = self.lin[layer], self.read[0]
        return self.conv[i][rows], self.state[i][rows], self.valid

    def linear_write(self, layer: int, window: Tensor, state: Tensor, slots: Tensor | None = None):
        """Store (B, K-1, C) windows and (B, Hv, Dk, Dv) states into `slots` (default: the rows read)."""
        i = self.lin[layer]
        slots = self.read[0] if slots is None else slots
        self.conv[i][slots] = window.to(self.conv.dtype)
        self.state[i][slots] = state.to(self.state.dtype)

    def fork(self, src: int, dst: list[int], length: int):
        """KVCache.fork, and the linear layers' state as it is now (`length` must be where src is)."""
        super().fork(src, dst, length)
        if dst:
            idx = to_device(dst, self.conv.device)
            self.conv[:, idx] = self.conv[:, src].unsqueeze(1)
            self.state[:, idx] = self.state[:, src].unsqueeze(1)

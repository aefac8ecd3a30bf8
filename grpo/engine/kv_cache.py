"""The sampler's KV cache: `slots` rows of `max_seq_len` positions per layer, allocated once.

Slotted, not paged. A row's keys are contiguous, so decode (grpo/engine/decode.py) attends over a
plain view of the buffer (no gather): SDPA, our decode_attention kernel and flash-attn's KV-cache
kernel all read the layout (slots, S, n_kv, D) with per-row lengths, and every decode tensor has
a static shape that a CUDA graph can replay. The price: a slot reserves max_seq_len positions whatever its row
uses, and a prompt shared by n samples is copied into n slots (`fork`) rather than
referenced; both are small next to the weights at the sizes grpo trains.

For the model's own forward (prefills and tool observations; decode steps write through
grpo/engine/decode.py) it speaks the model's hook (grpo/models/layers.py, Attention.forward):
`update(layer, k, v)` stores this forward's keys and values and returns what to attend over. Before
each forward the sampler says where the new tokens go: `packed` (a prefill of fresh prompts packed in one
row: attend to the new k, v under the model's own document mask) or `rows` (rows that continue
their history: an injected tool observation).
"""
import torch
from torch import Tensor


class KVCache:
    def __init__(self, args, slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        L, nkv, D = args.n_layers, args.n_kv_heads, args.head_dim
        if torch.device(device).type == "cpu":
            # heads first in memory, seen as (L, slots, S, nkv, D): a slot's keys of one head are one
            # (S, D) block, so decode's attention reads (rows x heads) contiguous blocks in one batched
            # matmul (SmolLM2, 48 rows, 250 keys: 2.4 ms a layer against 3.3 through the strided layout)
            self.k = torch.zeros(L, slots, nkv, max_seq_len, D, dtype=dtype, device=device).transpose(2, 3)
            self.v = torch.zeros(L, slots, nkv, max_seq_len, D, dtype=dtype, device=device).transpose(2, 3)
        else:  # the layout flash-attn's KV-cache kernel reads; our Triton kernels take either (strides)
            # (L, slots, S, nkv, D)
            self.k = torch.zeros(L, slots, max_seq_len, nkv, D, dtype=dtype, device=device)
            self.v = torch.zeros(L, slots, max_seq_len, nkv, D, dtype=dtype, device=device)
        self.slots, self.max_seq_len = slots, max_seq_len
        self.read = None  # (rows, span, mask) in `rows` mode; None in `packed` mode

    @staticmethod
    def slot_bytes(args, max_seq_len: int, dtype: torch.dtype) -> int:
        bits = torch.finfo(dtype).bits
        return 2 * args.n_layers * max_seq_len * args.n_kv_heads * args.head_dim * bits // 8

    def packed(self, slot: Tensor, pos: Tensor):
        """The next forward is one packed row of fresh prompts; token t goes to (slot[t], pos[t])."""
        self.w_slot, self.w_pos = slot, pos
        self.w_b, self.w_t = torch.zeros_like(pos), torch.arange(len(pos), device=pos.device)
        self.read = None

    def rows(self, rows, start: Tensor, T: int, span: int, valid: Tensor | None = None,
             real: tuple[Tensor, Tensor] | None = None):
        """The next forward is (B, T) tokens continuing rows `rows` (a slice of slots, a view,
        or an index tensor, a gather) from positions `start` (B,); keys [0, span) are read.
        `valid` (B, T) bool marks real tokens in a padded batch; the rest are not stored. `real`:
        valid's (row, column) indices, where the caller has them on the host (else valid.nonzero(), a
        host sync)."""
        B = len(start)
        q_pos = start[:, None] + torch.arange(T, device=start.device)  # (B, T)
        if real is not None:
            b, t = real
        elif valid is not None:
            b, t = valid.nonzero(as_tuple=True)
        else:
            b = torch.arange(B, device=start.device).repeat_interleave(T)
            t = torch.arange(T, device=start.device).repeat(B)
        slot_of = torch.arange(self.slots, device=start.device)[rows]  # (B,)
        self.w_slot, self.w_pos, self.w_b, self.w_t = slot_of[b], q_pos[b, t], b, t
        mask = torch.arange(span, device=start.device) <= q_pos[..., None]  # (B, T, span): causal, history
        self.read = (rows, span, mask[:, None])

    def update(self, layer: int, k: Tensor, v: Tensor):  # k, v (B, nkv, T, D), rotary applied
        # (N, nkv, D) real tokens only; bf16 under autocast, stored in the cache's dtype
        self.k[layer][self.w_slot, self.w_pos] = k[self.w_b, :, self.w_t].to(self.k.dtype)
        self.v[layer][self.w_slot, self.w_pos] = v[self.w_b, :, self.w_t].to(self.v.dtype)
        if self.read is None:
            return k, v, None  # packed prefill: the model's document mask over the new tokens
        rows, span, mask = self.read
        # (B, span, nkv, D) -> (B, nkv, span, D): a strided view when rows is a slice
        return self.k[layer][rows, :span].transpose(1, 2), self.v[layer][rows, :span].transpose(1, 2), mask

    def fork(self, src: int, dst: list[int], length: int):
        """Copy row `src`'s first `length` positions into rows `dst`, every layer: a prompt into
        its samples' rows, or a prefix of a longer prefilled sequence into the rows that continue
        from it (a causal prefix's keys and values do not depend on the tokens after it)."""
        if dst:
            idx = to_device(dst, self.k.device)
            self.k[:, idx, :length] = self.k[:, src, :length].unsqueeze(1)
            self.v[:, idx, :length] = self.v[:, src, :length].unsqueeze(1)


def to_device(values, device, dtype: torch.dtype | None = None) -> Tensor:
    """torch.tensor(values, device=device) without making the host wait. A copy from pageable host
    memory to a GPU first waits for the stream to drain (the decode window in flight, whose next
    window the host means to prepare meanwhile); from page-locked memory it is queued like a kernel
    (torch's pinned allocator keeps the block until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

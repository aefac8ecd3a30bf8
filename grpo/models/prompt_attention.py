"""share_prompt's attention (grpo/shared_prompt.py lays out the rows): each completion attends to its
prompt and to itself, never to its siblings."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class SharedPrompts:
    """Rows that hold a prompt once and then its completions (shared_prompt_batch).
    Indices point into the R * L tokens of the (R, L) batch, flattened; R * L itself is padding,
    a zero slot. The prompt is stored without its last token, which opens every completion's
    segment instead (its output predicts that completion's first token)."""
    prompt: Tensor       # (R, Pm) each row's prompt tokens, padded
    segment: Tensor      # (S, Mm) each completion segment's tokens, padded
    segment_row: Tensor  # (S,) the row of each segment
    mask: Tensor         # (S, 1, Mm, Pm + Mm) bool: a segment's query reads its row's real prompt
                         # tokens, then its own segment causally

    def to(self, device) -> "SharedPrompts":
        return SharedPrompts(*(t.to(device)
                               for t in (self.prompt, self.segment, self.segment_row, self.mask)))


def shared_prompt_attention(q: Tensor, k: Tensor, v: Tensor, sp: SharedPrompts, gqa: bool) -> Tensor:
    """Each completion attends to its prompt and to itself, never to its siblings: the prompts in
    one causal SDPA call, the segments in one masked call over (prompt + segment) keys, so the
    work is that of one row per sequence minus the repeated prompts. A dense (L x L) tree mask
    instead ran SDPA's math kernel over every pair of tokens in a row, which ate most of the savings
    (bench/shared_prompt.py; bench/RESULTS.md has the figures). q (R, nh, L, D), k, v (R, nkv, L, D)
    -> (R, nh, L, D)."""
    R, nh, L, D = q.shape
    flat = lambda t: torch.cat([t.transpose(1, 2).reshape(R * L, t.shape[1], D),  # noqa: E731
                                t.new_zeros(1, t.shape[1], D)])                    # (R*L + 1, heads, D)
    qf, kf, vf = flat(q), flat(k), flat(v)
    take = lambda t, idx: t[idx].transpose(1, 2)  # noqa: E731  (N, M) -> (N, heads, M, D)
    yp = F.scaled_dot_product_attention(take(qf, sp.prompt), take(kf, sp.prompt), take(vf, sp.prompt),
                                        is_causal=True, enable_gqa=gqa)            # (R, nh, Pm, D)
    keys = torch.cat([sp.prompt[sp.segment_row], sp.segment], 1)                  # (S, Pm + Mm)
    ys = F.scaled_dot_product_attention(take(qf, sp.segment), take(kf, keys), take(vf, keys),
                                        attn_mask=sp.mask, enable_gqa=gqa)         # (S, nh, Mm, D)
    y = q.new_zeros(R * L + 1, nh, D)
    y = y.index_put((sp.prompt.reshape(-1),), yp.transpose(1, 2).reshape(-1, nh, D))
    y = y.index_put((sp.segment.reshape(-1),), ys.transpose(1, 2).reshape(-1, nh, D))  # padding: slot R*L
    return y[:R * L].view(R, L, nh, D).transpose(1, 2)

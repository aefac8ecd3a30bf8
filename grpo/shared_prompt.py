"""share_prompt: an update computes each group's prompt once for all its G completions.

One row holds a prompt (without its last token) and then, for each of its completions, that last
token again and the completion: the last prompt token's output predicts a different first token
for each completion, so each needs its own copy. Each completion attends to the prompt and to
itself, never to its siblings (grpo/models/prompt_attention.py, which the model's attention calls for a
SharedPrompts layout); grpo.update gathers the log-probs back into the per-sequence layout its
loss reads. Fewer tokens forwarded, and a faster update, the longer the prompt and the larger G
(bench/shared_prompt.py; bench/RESULTS.md has the figures).
"""
import torch

from grpo.models.prompt_attention import SharedPrompts


def prompt_rows(trajs: list, keep: list[int], budget: int) -> list[tuple[list[int], int]]:
    """share_prompt: the kept sequences grouped by prompt into rows of (indices, tokens), each at
    most `budget` tokens: the prompt once without its last token, then for each sequence that
    token again and the completion. The last prompt token's output predicts a different first
    token for each completion, so each completion needs its own copy of it."""
    rows, open_rows = [], {}
    for i in keep:
        prompt, need = tuple(trajs[i].prompt_ids), len(trajs[i].completion_ids) + 1
        row = open_rows.get(prompt)
        if row is None or row[1] + need > budget:
            row = open_rows[prompt] = [[], len(prompt) - 1]
            rows.append(row)
        row[0].append(i)
        row[1] += need
    return [tuple(row) for row in rows]


def shared_prompt_batch(rows: list[list], device) -> dict:
    """Rows of one prompt's sequences (prompt_rows) -> (R, L) input_ids, position_ids, labels, the
    rows' layout for the model's shared-prompt attention (SharedPrompts: each
    completion attends to the prompt and to itself only), and `index` (N, T): where each of
    collate's (N, T) positions of these N sequences, in row order, lies in the flattened (R * L)
    rows (R * L, one past the end, where none: it reads a zero). A group of G sequences computes
    its prompt once instead of G times."""
    R, N = len(rows), sum(len(r) for r in rows)
    L = max(len(r[0].prompt_ids) - 1 + sum(len(t.completion_ids) + 1 for t in r) for r in rows)
    T = max(len(t.prompt_ids) + len(t.completion_ids) for r in rows for t in r)
    Pm = max(1, max(len(r[0].prompt_ids) - 1 for r in rows))
    Mm = max(len(t.completion_ids) + 1 for r in rows for t in r)
    input_ids, position_ids = torch.zeros(R, L, dtype=torch.long), torch.zeros(R, L, dtype=torch.long)
    labels = torch.full((R, L), -100, dtype=torch.long)
    index, n = torch.full((N, T), R * L, dtype=torch.long), 0
    prompt_at, segment_at = (torch.full((R, Pm), R * L, dtype=torch.long),
                             torch.full((N, Mm), R * L, dtype=torch.long))
    segment_row, mask = torch.zeros(N, dtype=torch.long), torch.zeros(N, 1, Mm, Pm + Mm, dtype=torch.bool)
    causal = torch.ones(Mm, Mm, dtype=torch.bool).tril()
    for r, row in enumerate(rows):
        prompt = row[0].prompt_ids
        P, s = len(prompt), len(prompt) - 1
        input_ids[r, :s], position_ids[r, :s] = torch.tensor(prompt[:-1], dtype=torch.long), torch.arange(s)
        prompt_at[r, :s] = r * L + torch.arange(s)
        for t in row:
            C = len(t.completion_ids)
            input_ids[r, s:s + C + 1] = torch.tensor(prompt[-1:] + t.completion_ids)
            position_ids[r, s:s + C + 1] = torch.arange(P - 1, P + C)
            ids, scored = torch.tensor(t.completion_ids), torch.tensor(t.loss_mask, dtype=torch.bool)
            labels[r, s:s + C] = torch.where(scored, ids, -100)
            index[n, P - 1:P - 1 + C] = r * L + torch.arange(s, s + C)
            segment_at[n, :C + 1], segment_row[n] = r * L + torch.arange(s, s + C + 1), r
            mask[n, 0, :, :P - 1] = True   # the row's real prompt tokens
            mask[n, 0, :, Pm:] = causal    # its own segment, causally (padded queries read its first token)
            s, n = s + C + 1, n + 1
    out = dict(input_ids=input_ids, position_ids=position_ids, labels=labels, index=index)
    if any(t.kept_thresholds for r in rows for t in r):  # each token's kept set, as grpo/update.py's collate
        out["thresholds"] = torch.full((R * L,), float("-inf"))
        for n, t in enumerate(t for r in rows for t in r):
            P, C = len(t.prompt_ids), len(t.kept_thresholds)
            out["thresholds"][index[n, P - 1:P - 1 + C]] = torch.tensor(t.kept_thresholds)
        out["thresholds"] = out["thresholds"].view(R, L)
    return {k: v.to(device) for k, v in out.items()} | {
        "layout": SharedPrompts(prompt_at, segment_at, segment_row, mask).to(device)}

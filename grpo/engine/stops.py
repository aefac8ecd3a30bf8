"""Stop strings: which tokens can complete one (checked only there), and where one ends a row's tokens.

A string first appears at the token that adds its last character, so the sampler decodes a row's recent
text only at tokens that may complete one: a tokenizer decode on a few tokens in a hundred."""
from grpo.engine.rows import Call, Row


def string_ends(tokenizer, V: int, strings: list[str]) -> list[bool]:
    """(V,) whether token v can complete one of `strings`: the text it adds after a plain
    character holds a string's last character, or is partial UTF-8 (U+FFFD: its characters
    appear only beside its neighbours), or is empty. One batch decode of the vocabulary."""
    tk = tokenizer
    known = min(V, len(tk)) if hasattr(tk, "__len__") else V  # padded rows past its ids stay candidates
    # after a plain token, so that a SentencePiece word start keeps its space (a tokenizer
    # with decode() alone, as the sampler needs, decodes each token by itself)
    anchor = tk.encode("a", add_special_tokens=False)[:1] if hasattr(tk, "encode") else []
    base = tk.decode(anchor)
    lasts = {x[-1] for x in strings if x}
    ids = [anchor + [v] for v in range(known)]
    texts = tk.batch_decode(ids) if hasattr(tk, "batch_decode") else [tk.decode(x) for x in ids]
    return [not t.startswith(base) or not (added := t[len(base):]) or "\ufffd" in added
            or any(c in added for c in lasts) for t in texts] + [True] * (V - known)


def find_stop_string(tokenizer, call: Call, s: Row, start: int) -> tuple[int, bool, bool] | None:
    """The first of the row's tokens from `start` at which this turn's text (its last call.tail tokens)
    holds a stop string: (its index, a tool stop string?, a stop string?), or None."""
    p = call.params
    for j in range(start, len(s.token_ids)):
        tok = s.token_ids[j]
        if tok in call.tool_stops or tok in call.stops or not call.string_end[tok]:
            continue
        text = tokenizer.decode(s.token_ids[max(s.turn_start, j + 1 - call.tail): j + 1])
        is_tool, is_stop = any(x in text for x in p.tool_stop_strings), any(x in text for x in p.stop_strings)
        if is_tool or is_stop:
            return j, is_tool, is_stop
    return None

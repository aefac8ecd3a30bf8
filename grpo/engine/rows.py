"""What a sampler call holds: its settings (SamplingParams), its results (Completion), and while it runs
its rows (Row: a Completion plus its slot, prompt and random key) and their places (Call)."""
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SamplingParams:
    n: int = 1                      # G: completions per prompt
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    min_p: float = 0.0
    max_tokens: int = 256           # completion tokens, sampled + injected
    stop_token_ids: list[int] | None = None  # None = every EOS id of the model's generation_config
    stop_strings: list[str] = field(default_factory=list)
    tool_stop_token_ids: list[int] = field(default_factory=list)  # end a turn with a tool call
    tool_stop_strings: list[str] = field(default_factory=list)
    max_turns: int = 8              # assistant turns; one more tool call ends the row with "turns"
    max_turn_tokens: int = 0        # tokens one assistant turn may sample (then "length"); 0 = no limit
    seed: int | None = None         # None = drawn from torch's global generator
    kept_set: bool = True           # filtered: log-probs over the kept set, renormalised (False: all of V)

    def __post_init__(self):
        checks = [(self.n >= 1, "n >= 1"), (self.temperature >= 0, "temperature >= 0"),
                  (0 < self.top_p <= 1, "0 < top_p <= 1"), (self.top_k >= 0, "top_k >= 0"),
                  (0 <= self.min_p < 1, "0 <= min_p < 1"), (self.max_tokens >= 1, "max_tokens >= 1"),
                  (self.max_turns >= 1, "max_turns >= 1"),
                  (self.max_turn_tokens >= 0, "max_turn_tokens >= 0")]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams needs {what}: got {self}")


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)  # after the prompt: sampled and injected
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on injected ones
    # log softmax(logits / T) over the kept set, 0 on injected
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""         # "stop" | "length" | "turns" | "error" (bad request or tool failure)
    num_turns: int = 1
    error: str | None = None
    # per token, the kept set's threshold on logits / T (grpo/engine/sampling.py); -inf: the whole vocabulary
    thresholds: list[float] = field(default_factory=list)


class Row(Completion):  # a request in flight: a Completion plus where it lives
    def __init__(self, index: int, i: int, j: int, prompt: list[int], key: int, max_tokens: int, doc: int):
        super().__init__(i, j)
        self.index, self.prompt, self.key, self.max_tokens = index, prompt, key, max_tokens
        self.doc = doc  # prompts of one document are prefixes of each other: their KV is shared
        self.slot, self.turn_start, self.in_tool = -1, 0, False
        self.epoch = 0  # bumped when the row stops decoding: a window launched before then is not its
        # a token sampled on device after a tool observation, not read back yet: the host takes it with
        # the next window's tokens (the decode state's column 0), so a tool turn needs no host sync
        self.lead = False


@dataclass
class Call:
    """One generate() call: its settings and where each of its requests is."""
    params: SamplingParams
    tool: Callable | None           # tool(index, completion_ids) -> observation ids | None
    out: list                       # (prompts x n) Completion or finished Row, in request order
    stops: set[int]                 # token ids that end a row
    tool_stops: set[int]            # token ids that end a turn with a tool call
    tail: int                       # tokens decoded per stop-string check (0 = no stop strings)
    string_end: list | None         # (V,) bool: the tokens that can complete a stop string
    unadmitted: list[int]           # per prompt: samples still waiting (its logits are kept till 0)
    members: dict                   # document -> [(prompt index, prompt length)]
    bar: object = None              # progress bar (or a do-nothing one)
    waiting: deque = field(default_factory=deque)  # Row not yet in a slot, in queue order (Scheduler.start)
    live: dict = field(default_factory=dict)       # slot -> Row, decoding or in a tool call
    pending: dict = field(default_factory=dict)    # tool future -> Row
    prompt_logits: dict = field(default_factory=dict)  # prompt index -> (V,) logits of its last token
    in_flight: tuple | None = None  # pipelined: the launched window whose tokens are not taken yet

    @property
    def busy(self) -> bool:  # a row waits, decodes, runs a tool, or has tokens in flight
        return bool(self.waiting or self.live or self.pending or self.in_flight)


def turn_limit(call: Call, s: Row) -> int:
    """The length at which the row stops: its max_tokens, or sooner, its turn's max_turn_tokens."""
    per_turn = call.params.max_turn_tokens
    return min(s.max_tokens, s.turn_start + per_turn) if per_turn else s.max_tokens


def public(s: Row) -> Completion:
    return Completion(s.prompt_index, s.sample_index, s.token_ids, s.loss_mask, s.logprobs, s.finish_reason,
                      s.num_turns, s.error, s.thresholds)

"""The environment contract: what the rollouts, the rewards, the warm-start and the evals call on an env.

An env is a plain class. Two members are required:
    prompt(example) -> chat messages (or a raw text prompt)
    reward(example, trajectory) -> {term: float or None}   (None: not applicable, left out of the sum)
The rest are optional; `Env` below holds their defaults (a single-turn task scored by "correct"). Subclass
it to inherit them, or write a plain class: `as_env(env)` fills what a plain class leaves out. It is the
one place that asks what an env has; the trainer and the rollouts read every member directly.
docs/your_task.md lists the same members.
"""


class Env:
    """The contract with its defaults. Multi-turn (a tool): set stop_strings and write step()."""
    stop_strings: tuple = ()          # tool-call stops: the sampler pauses there and calls step();
                                      # () = single turn
    max_turns: int = 1                # assistant turns per episode (with stop_strings)
    observation_role: str = "user"    # the chat role step()'s text is rendered as ("tool" for native
                                      # tool calls)
    chat_kwargs: dict = {}            # passed to the chat template with every prompt (e.g. tools=[...])
    score_term: str = "correct"       # the reward term that means "solved": evals, ProcessGRPO's success rate
    reward_batch = None               # reward_batch(examples, trajectories) -> [terms], in place of
                                      # reward() a row
    gold_messages = None              # gold_messages(example) -> [assistant, observation, ...]: the SFT
                                      # warm-start

    def prompt(self, example: dict):
        raise NotImplementedError

    def reward(self, example: dict, trajectory) -> dict:
        raise NotImplementedError

    def step(self, text: str) -> str | None:
        """A turn that stopped on a tool call -> the observation's text, or None to end the episode."""
        return None

    def answered(self, trajectory) -> bool:
        """Whether a completion cut at the token limit had answered already (keep_truncated_answers)."""
        return False

    def extract(self, trajectory):
        """The answer an eval record shows (None: none)."""
        return None


REQUIRED = ("prompt", "reward")
OPTIONAL = tuple(k for k in vars(Env) if not k.startswith("_") and k not in REQUIRED)


class EnvView:
    """A plain env seen through the contract: its own members first, Env's defaults for the rest."""

    def __init__(self, env, optional: tuple = OPTIONAL):
        self.env, self.optional = env, optional

    def __getattr__(self, name: str):  # only for names not set on the view itself
        try:
            return getattr(self.env, name)
        except AttributeError:
            if name not in self.optional:
                raise
        # an env asked only for its prompts and tool (rewards=False): no terms of its own
        if name == "reward":
            return lambda example, trajectory: {}
        default = vars(Env)[name]
        return default.__get__(self) if callable(default) else default


def as_env(env, rewards: bool = True) -> Env | EnvView:
    """`env` with every optional member answered (the defaults above where it has none); a missing
    required member is a one-line error. rewards=False: reward() is optional too (an env that only
    supplies prompts and a tool to reward functions, grpo.rewards), and gives no terms where missing."""
    if isinstance(env, (Env, EnvView)):
        return env
    required = REQUIRED if rewards else ("prompt",)
    missing = [k for k in required if not callable(getattr(env, k, None))]
    if missing:
        raise TypeError(f"{type(env).__name__} is not an env: "
                        f"it needs {' and '.join(f'{k}()' for k in missing)} "
                        "(grpo.env.Env lists the contract)")
    return EnvView(env, OPTIONAL if rewards else OPTIONAL + ("reward",))

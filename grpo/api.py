"""TRL's GRPOTrainer, in its shape, over grpo.trainer.train: the same run as the recipes.

    from grpo import GRPOTrainer, GRPOConfig
    def correct(prompts, completions, answer, **kwargs):       # written for TRL, unchanged
        return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]
    trainer = GRPOTrainer(model="path/to/checkpoint", reward_funcs=[correct],
                          args=GRPOConfig(output_dir="runs/mine", max_steps=50), train_dataset=dataset)
    trainer.train()

Datasets: a `datasets.Dataset` or a list of dicts with a `prompt` column, in TRL's standard form
(text, given to the model as is, without a chat template, as TRL does) or its conversational form
(chat messages, rendered by the tokenizer's chat template); other columns (an answer, or none)
reach the reward functions as keyword lists. Reward functions: TRL's convention (grpo.rewards).
Where we differ from TRL:
- `model` is a checkpoint folder or hub id (a transformers model: the folder it was loaded from);
  the tokenizer is the folder's own, so `processing_class` must be None;
- `args` is grpo.config.Config (TRL's names where the idea is the same; grpo.flags.TRL_NAMES says
  what replaces the others); `reward_weights` is an argument here or a field of a recipe's config;
- no reward models (a string in `reward_funcs`), no `trainer_state` keyword for the functions;
- eval: `eval_dataset` is scored by the first reward function (mean@k, pass@k with intervals),
  before and after training, not an eval loss;
- `env`: an env of our own protocol (grpo.trainer.train) for prompts and multi-turn tools
  (`step`, `stop_strings`); the reward functions then score its episodes;
- `peft_config`: a `peft.LoraConfig` (its r, lora_alpha, lora_dropout, target_modules, use_rslora;
  any other option that is on, such as use_dora or aLoRA's alora_invocation_tokens, is refused),
  trained by grpo.models.lora without peft; the same as the Config fields use_peft, lora_r, ...
`from grpo import GRPOTrainer, GRPOConfig` works as in TRL (GRPOConfig is grpo.config.Config).
"""
import dataclasses

from grpo.config import Config
from grpo.rewards import RewardFunctionsEnv, is_conversational


def dataset_examples(dataset, name: str) -> list[dict]:
    """A datasets.Dataset (or any iterable of dicts) -> examples with a `question` text for the
    eval records; one-line errors for rows without a usable `prompt`."""
    examples = []
    for i, row in enumerate(dataset):
        if not isinstance(row, dict) or "prompt" not in row:
            keys = sorted(row)[:10] if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{name} row {i}: no 'prompt' column (TRL's standard or conversational form); "
                             f"the row has {keys}")
        p = row["prompt"]
        if is_conversational(p):
            user = [m.get("content") for m in p if m.get("role") == "user"]
            question = str(user[-1] if user else p[-1].get("content"))
        elif isinstance(p, str) and p.strip():
            question = p
        else:
            raise ValueError(f"{name} row {i}: 'prompt' is neither text nor chat messages "
                             f"[{{'role': ..., 'content': ...}}]: {str(p)[:80]!r}")
        examples.append({**row, "question": row.get("question", question)})
    if not examples:
        raise ValueError(f"{name} is empty")
    columns = dict.fromkeys(k for e in examples for k in e)  # every row gets every column, None where it
    return [{k: e.get(k) for k in columns} for e in examples]  # had none (as datasets.Dataset.from_list)


def model_folder_of(model) -> str:
    """A path or hub id as given; a loaded transformers model as the folder it came from."""
    if isinstance(model, str):
        return model
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path:
        raise ValueError(f"model: pass a checkpoint folder or hub id (a {type(model).__name__} that was not "
                         "loaded from a folder: save it first with model.save_pretrained(folder))")
    return str(path)


def reward_names(funcs: list) -> dict:
    """{name: fn}, named as TRL logs them (the function's __name__), made unique."""
    out = {}
    for fn in funcs:
        if isinstance(fn, str):
            raise ValueError(f"reward_funcs: {fn!r}: reward models are not supported; pass functions")
        if not callable(fn):
            raise ValueError(f"reward_funcs: {fn!r} is not callable")
        name = getattr(fn, "__name__", type(fn).__name__)
        k, base = 2, name
        while name in out:
            name, k = f"{base}_{k}", k + 1
        out[name] = fn
    return out


def lora_fields(peft_config) -> dict:
    """A peft.LoraConfig (read by its field names: peft itself is not imported) -> our Config's LoRA
    fields; None -> none. Options that change the arithmetic of grpo.models.lora are refused, not ignored."""
    if peft_config is None:
        return {}
    if str(getattr(peft_config, "peft_type", "LORA")).rsplit(".", 1)[-1] != "LORA":
        raise ValueError(f"peft_config: {type(peft_config).__name__} is not a LoRA config "
                         "(only LoRA is supported)")
    from grpo.models.lora import IMPLEMENTED, refused_options
    fields = dataclasses.fields(peft_config) if dataclasses.is_dataclass(peft_config) else ()
    options = {f.name: getattr(peft_config, f.name) for f in fields} or dict(vars(peft_config))
    # adapters start as ours do: PEFT's default init (True), nothing else; every field we do not
    # implement is off
    odd = refused_options(options, inits=(True,))
    if odd:
        raise ValueError(f"peft_config: unsupported LoRA options {', '.join(odd)} (plain LoRA only: "
                         f"{', '.join(IMPLEMENTED)})")
    # no target_modules: None, PEFT's own default for the architecture (grpo.models.lora.PEFT_DEFAULT_TARGETS)
    targets = getattr(peft_config, "target_modules", None) or None
    if targets is not None and not isinstance(targets, str):
        targets = ",".join(sorted(targets))
    return dict(use_peft=True, lora_r=int(peft_config.r), lora_alpha=peft_config.lora_alpha,
                lora_dropout=float(peft_config.lora_dropout),
                use_rslora=bool(getattr(peft_config, "use_rslora", False)),
                lora_target_modules=targets)


class GRPOTrainer:
    def __init__(self, model, reward_funcs=None, args: Config | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_weights: list | None = None, env=None,
                 peft_config=None):
        if processing_class is not None:
            raise ValueError("processing_class: the tokenizer is the model folder's own; pass None")
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        funcs = (reward_funcs if isinstance(reward_funcs, (list, tuple))
                 else [reward_funcs] if reward_funcs else [])
        self.reward_funcs = reward_names(funcs)
        if not self.reward_funcs and env is None:
            raise ValueError("reward_funcs: pass at least one reward function (or an env that rewards)")
        self.args = dataclasses.replace(args or Config(), model_path=model_folder_of(model),
                                        **lora_fields(peft_config))
        self.args.check()
        weights = reward_weights if reward_weights is not None else getattr(self.args, "reward_weights", None)
        if isinstance(weights, str):  # a recipe's comma-separated field
            weights = [float(w) for w in weights.split(",")] if weights.strip() else None
        weights = list(weights) if weights else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"{len(weights)} reward_weights for {len(self.reward_funcs)} reward_funcs")
        self.reward_weights = dict(zip(self.reward_funcs, map(float, weights)))
        self.train_dataset = dataset_examples(train_dataset, "train_dataset")
        self.eval_dataset = dataset_examples(eval_dataset, "eval_dataset") if eval_dataset is not None else []
        self.env = RewardFunctionsEnv(self.reward_funcs, raw_text=True, base=env)
        self.results = None

    def train(self) -> dict:
        """The run (grpo.trainer.train); returns the eval results ({phase: mean, ci95, ...})."""
        from grpo.trainer import train
        self.results = train(self.args, self.env, self.train_dataset, self.eval_dataset,
                             reward_weights=self.reward_weights)
        return self.results

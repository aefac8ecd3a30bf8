"""One training run for tests/test_dist.py, under `torchrun` (2 ranks) or plain `python` (1).

    python -m torch.distributed.run --nproc_per_node=2 tests/dist_worker.py --model_path=DIR --output_dir=DIR ...
Takes any Config field as --field=value, plus
  --sigterm_at_step=K  rank 0 sends itself SIGTERM while scoring step K (1-based), the way a
                       scheduler would: the run must save at the end of step K and exit cleanly
                       on every rank (the ranks agree through an all-reduce of the flag);
  --raise_at_step=K    rank `raise_on_rank` (default 1) raises in its reward function at step K;
  --stall_at_step=K    the other ranks stall in theirs (an hour) at step K: a rank that no
                       collective error will wake, as one on another node under NCCL;
  --fast_clock_rank=R  rank R's trainer clock runs 10,000 times fast (its time budget ends first);
  --hide_newest_checkpoint_on_rank=R  rank R does not see the newest checkpoint folder (a network
                       filesystem's stale view);
  --check_fsdp=DIR     before training, check the FSDP pieces on the model in DIR (e.g. one
                       with tied embeddings) against an unsharded copy (check_fsdp below),
                       export it to <output_dir>/check_export, print "fsdp checks passed".
Every rank prints "rank R: N gold trajectories" at the end (the warm-start's share of examples).
"""
import itertools
import os
import signal
import sys
import time
import types
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(__file__))  # toy.py

from toy import ToyEnv  # noqa: E402

from grpo import (
    sft,
    trainer,  # noqa: E402
)
from grpo.config import Config  # noqa: E402
from grpo.engine.sampler import Sampler, SamplingParams  # noqa: E402
from grpo.fit import budget  # noqa: E402
from grpo.flags import parse_args
from grpo.infra import dist
from grpo.infra.checkpoint import Checkpointer, export  # noqa: E402
from grpo.models.model import Transformer  # noqa: E402
from grpo.trainer import train  # noqa: E402

EXAMPLES = [{"question": f"w{i} w{i + 1}", "answer": ""} for i in range(40)]


@dataclass
class WorkerConfig(Config):
    sigterm_at_step: int = 0  # 0 = never
    raise_at_step: int = 0  # 0 = never
    raise_on_rank: int = 1
    stall_at_step: int = 0  # 0 = never
    fast_clock_rank: int = -1  # -1 = none
    hide_newest_checkpoint_on_rank: int = -1  # -1 = none
    check_fsdp: str = ""  # a model folder; "" = no checks


RANK = int(os.environ.get("RANK", "0"))


class FaultEnv(ToyEnv):
    """ToyEnv that, at the first reward of a step (counted in calls), sends rank 0 SIGTERM
    (`sigterm_at`), raises on one rank (`raise_at`, `raise_rank`) or stalls the others (`stall_at`)."""
    def __init__(self, per_step: int, sigterm_at: int = 0, raise_at: int = 0, raise_rank: int = 1,
                 stall_at: int = 0):
        first_call = lambda step: (step - 1) * per_step + 1 if step > 0 else -1  # noqa: E731
        self.sigterm_call = first_call(sigterm_at) if RANK == 0 else -1
        self.raise_call = first_call(raise_at) if RANK == raise_rank else -1
        self.stall_call = first_call(stall_at) if RANK != raise_rank else -1
        self.calls = itertools.count(1)  # assign_rewards() calls reward from threads: next() on a count is atomic

    def reward(self, example, trajectory):
        call = next(self.calls)
        if call == self.sigterm_call:
            os.kill(os.getpid(), signal.SIGTERM)
        if call == self.raise_call:
            raise ValueError(f"reward function failed on purpose (rank {RANK})")
        if call == self.stall_call:
            time.sleep(3600)
        return super().reward(example, trajectory)

    def gold_messages(self, example):  # the warm-start's demonstration (used when --sft_steps > 0)
        return [{"role": "assistant", "content": "w0 w1 w2 w3"}]


def install_faults(cfg: "WorkerConfig") -> list:
    """The clock and folder-view hooks of the flags above, on this rank; returns the list that
    counts the gold trajectories this rank renders."""
    if RANK == cfg.fast_clock_rank:
        start = time.time()
        fast = types.SimpleNamespace(time=lambda: start + (time.time() - start) * 10_000)
        trainer.time = budget.time = fast  # the loop's clock and the stop rule's
    if RANK == cfg.hide_newest_checkpoint_on_rank:
        complete = Checkpointer.complete
        Checkpointer.complete = lambda self: complete(self)[:-1]
    golds, gold_trajectory = [], sft.gold_trajectory
    sft.gold_trajectory = lambda *a, **k: golds.append(1) or gold_trajectory(*a, **k)
    return golds


def check_fsdp(path: str, export_dir: str):
    """On every rank, against an unsharded copy of the same checkpoint:
    1. inside dist.gathered() the parameters are full plain tensors (a tied LM head still is the
       embedding), and a whole sampling call costs one all-gather per FSDP module, not one per
       decode step;
    2. the sampler draws the same tokens with the same log-probs as on the unsharded copy;
    3. afterwards the parameters are shards again;
    4. the `labels=` forward (the LM head used inside the root's forward) gives the same
       log-probs, and backward the same gradients, as the copy's;
    5. export() gathers the full weights to rank 0 (the test loads them with transformers)."""
    from torch.distributed.tensor import DTensor
    dist.init()
    full = Transformer.from_pretrained(path)
    model = dist.shard(Transformer.from_pretrained(path), torch.float32)
    tied = full.args.tie_embeddings
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5)
    prompts = [[3, 4, 7 + i, 9, 5] for i in range(4)]  # the same on every rank

    calls = []  # FSDP2's all-gather of one module's parameters (a private name: this counts, it changes nothing)
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
    all_gather = group.foreach_all_gather
    group.foreach_all_gather = lambda *a, **k: calls.append(1) or all_gather(*a, **k)
    with dist.gathered(model):
        w = model.layers[0].mlp.up_proj.weight
        assert not isinstance(w, DTensor) and w.shape == full.layers[0].mlp.up_proj.weight.shape, type(w)
        assert (model.lm_head.weight is model.embed_tokens.weight) == tied
        out = Sampler(model, gen_batch=8).generate(prompts, params)
    group.foreach_all_gather = all_gather
    n_modules = len(dist._fsdp_modules(model))
    assert len(calls) == n_modules, f"{len(calls)} all-gathers for {n_modules} FSDP modules while sampling"
    expected = Sampler(full, gen_batch=8).generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    for a, b in zip(out, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert isinstance(model.layers[0].mlp.up_proj.weight, DTensor)

    ids = torch.tensor(prompts)
    labels = torch.roll(ids, -1, 1)
    ours, theirs = model(ids, labels=labels, temperature=0.7), full(ids, labels=labels, temperature=0.7)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    ours.sum().backward()
    theirs.sum().backward()
    for (name, p), q in zip(model.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-4, msg=name)
    export(model, export_dir)
    dist.print0(f"fsdp checks passed ({n_modules} modules, tied={tied})")


if __name__ == "__main__":
    cfg = parse_args(WorkerConfig, sys.argv[1:] + ["--profile=none"])
    if cfg.check_fsdp:
        check_fsdp(cfg.check_fsdp, os.path.join(cfg.output_dir, "check_export"))
    world = int(os.environ.get("WORLD_SIZE", 1))
    env = FaultEnv(cfg.prompts_per_step // world * cfg.num_generations, cfg.sigterm_at_step,
                   cfg.raise_at_step, cfg.raise_on_rank, cfg.stall_at_step)
    golds = install_faults(cfg)
    train(cfg, env, EXAMPLES, EXAMPLES[:4], eval_env=ToyEnv())  # eval's rewards stay out of the count
    print(f"rank {RANK}: {len(golds)} gold trajectories", flush=True)

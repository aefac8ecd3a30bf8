"""--preflight: before step 1, one synthetic step at the rollouts', the update's and the optimizer step's
largest sizes, its measured peaks beside the memory plan's.

The rollouts: a step's rows on this rank, every prompt max_prompt_length random tokens, each row sampling
max_completion_length tokens (no stop) with the run's sampling settings. The update: the largest
micro-batch, as many rows of max_prompt_length + max_completion_length tokens as micro_batch_tokens
holds, through the log-probs (with entropy) and backward, as the update runs them. The step: the
optimizer's step on those gradients, as the run's steps allocate (AdamW's states are created here, and
its temporary), taken at learning rate 0 so that no weight moves. Nothing is kept: the weights as they
were, the optimizer's state and the gradients dropped, the random state restored. A run that would run
out of memory in these three phases does so here, in minutes, not hours in. Not run: the eval (whose
rows may be longer: the plan's eval phase covers it), the KL reference's and the old policy's log-prob
passes, and a recipe's own models (ProcessGRPO's continuations).

Measured: on CUDA the caching allocator's peak (torch.cuda.max_memory_allocated: the tensors, without
the CUDA context or fragmentation, so the plan's terms are compared without those two); on a CPU the
peak resident size (VmHWM, reset through /proc/self/clear_refs), the whole process as the plan counts it.
"""
import torch

from grpo.engine.cpu import trim
from grpo.engine.sampler import SamplingParams
from grpo.fit.memory import GIB, Plan
from grpo.infra import dist


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident size restarts from the current one
        except OSError:
            pass


def peak_bytes(device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def planned(plan: Plan, phase: str, optimizer_state: bool) -> int:
    """The plan's phase as the preflight measures it: without what the measurement does not see (the
    CUDA context, the allocator margin) or what does not exist yet (AdamW's states before the first step)."""
    skip = {"CUDA context"} | (set() if optimizer_state else {"AdamW's two states, fp32"})
    return sum(b for name, b, _ in plan.phases[phase] if name not in skip)


@torch.no_grad()
def optimizer_step_at_lr_0(optimizer):
    """One optimizer.step() that moves no weight, then its state dropped: AdamW at lr 0 decays by 1 - 0 x wd
    and adds -0 x exp_avg / denom, so each weight keeps its value (a -0.0 may become +0.0)."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.state.clear()  # no moments of a synthetic step's gradients in the run


def preflight(cfg, model, sampler, optimizer, device, plan: Plan) -> dict:
    """-> {phase: (planned bytes, measured bytes)} for the rollouts, the update and the optimizer step,
    printed on rank 0."""
    V, G = model.args.vocab_size, cfg.num_generations
    rows = max(1, cfg.prompts_per_step * G // dist.world_size())
    g = torch.Generator().manual_seed(cfg.seed)
    prompts = [torch.randint(0, V, (cfg.max_prompt_length,), generator=g).tolist()
               for _ in range(max(1, rows // G))]
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    training = model.training
    model.eval()
    reset_peak(device)
    with dist.gathered(model):
        sampler.generate(prompts, SamplingParams(n=G, temperature=cfg.temperature, top_p=cfg.top_p,
                                                 top_k=cfg.top_k, min_p=cfg.min_p,
                                                 max_tokens=cfg.max_completion_length,
                                                 stop_token_ids=[], seed=cfg.seed))
    measured = {"rollouts": peak_bytes(device)}
    if device.type == "cpu" or not cfg.keep_kv_cache:  # as a step releases them
        sampler.release()
    longest = cfg.max_prompt_length + cfg.max_completion_length
    ids = torch.randint(0, V, (max(cfg.micro_batch_tokens // longest, 1), longest), generator=g).to(device)
    model.train()
    reset_peak(device)
    # entropy: no gradient
    logprobs, _ = model(ids, labels=ids, temperature=cfg.temperature, return_entropy=True)
    logprobs.float().sum().backward()
    measured["update"] = peak_bytes(device)
    del logprobs
    if device.type == "cpu":
        trim()  # the update's freed activations back to the OS, as a CPU step does after its update
    reset_peak(device)
    optimizer_step_at_lr_0(optimizer)
    measured["step"] = peak_bytes(device)
    optimizer.zero_grad(set_to_none=True)
    model.train(training)
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1], device)
    out = {phase: (planned(plan, phase, phase == "step"), measured[phase]) for phase in measured}
    for phase, (want, got) in out.items():
        dist.print0(f"preflight {phase}: measured {got / GIB:.2f} GiB, planned {want / GIB:.2f} GiB "
                    f"({got / max(want, 1):.0%} of the plan)")
    return out

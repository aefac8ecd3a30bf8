"""The memory plan: what each rank holds at the peak of each phase of a run, before anything loads.

    plan = memory_plan(args, cfg, world=8, device="cuda", memory_gib=48)   # args: grpo.model.ModelArgs
    print(plan.table()); plan.fits; plan.peak
    python -m grpo.plan recipes/calculator_qwen25_3b.py --gpus 8 --gpu "RTX 6000 Ada"   # grpo/plan.py

A run has three phases, and each rank's memory peaks in one of them:
- rollouts: the sampler over the gathered weights (FSDP's unsharded compute-dtype copy), its resident
  decode copy (grpo/decode.py) and its KV cache, sized for the step's rows;
- eval: the same with the eval's rows and lengths (an eval's completions may be longer);
- update: gradients, the activations of one packed micro-batch and the fused log-prob's vocabulary chunk.
Through all three: the sharded master weights and AdamW's two states (and the KL reference's weights
when beta > 0); with keep_kv_cache on a GPU, the KV cache and the decode copy stay through the update.

Every term is a named line whose formula is in the comment where it is computed. What the plan does
not see: the allocator's fragmentation (a stated margin: 10% on a GPU), the CUDA context (a stated
constant), and on a CPU the process's runtime (Python, torch, transformers: a stated constant, measured).
Activations are counted per token and layer from the tensors autograd keeps in grpo/model.py's Block
(tests/test_memory.py measures them).
"""
import dataclasses
import json
import os
from dataclasses import dataclass, field

GIB = 2**30
# the recipes' models, by name: config.json's shape fields (a plan needs no network and no weights)
_QWEN = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6)
KNOWN = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(_QWEN, model_type="qwen2", hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "Qwen/Qwen2.5-3B-Instruct": dict(_QWEN, model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                                     num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
    "Qwen/Qwen3-0.6B": dict(_QWEN, model_type="qwen3", hidden_size=1024, intermediate_size=3072, head_dim=128,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8),
    "Qwen/Qwen3-4B-Instruct-2507": dict(_QWEN, model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                                        head_dim=128, num_hidden_layers=36, num_attention_heads=32,
                                        num_key_value_heads=8),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                                                intermediate_size=1536, num_hidden_layers=30,
                                                num_attention_heads=9, num_key_value_heads=3,
                                                tie_word_embeddings=True, rope_theta=1e5),
}
KNOWN["Qwen/Qwen3-4B"] = KNOWN["Qwen/Qwen3-4B-Instruct-2507"]
# the GPUs a plan knows by name: what each reports as its memory (nvidia-smi's total, GiB)
GPU_MEMORY_GIB = {"B200": 179.0, "H200": 140.4, "H100": 79.6, "A100-80": 80.0, "A100-40": 40.0,
                  "RTX 6000 Ada": 48.0, "L40S": 45.0, "L4": 22.5}
CUDA_CONTEXT = 0.6 * GIB   # the CUDA context, cuBLAS's workspace and Triton's modules on each rank
CPU_RUNTIME = 0.45 * GIB   # Python, torch, transformers and the tokenizer, resident before any tensor
GPU_MARGIN = 0.10          # the caching allocator's fragmentation, on top of every phase


def model_config(model_path: str) -> dict:
    """config.json of a local folder, else of a model this module knows by name (no network)."""
    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    if model_path in KNOWN:
        return dict(KNOWN[model_path])
    raise ValueError(f"no config.json under {model_path!r} and not a model the plan knows by name "
                     f"({', '.join(KNOWN)}): pass --model_path a local folder")


def counts(args) -> dict:
    """Parameters by part: one block's linear weights, its biases and norms, the root (embedding, LM head
    when untied, final norm), the whole model, and the LoRA adapters of all seven linear layers per rank r=1."""
    H, F, L, qd, kd = args.dim, args.ffn_dim, args.n_layers, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    linear = H * qd + 2 * H * kd + qd * H + 3 * H * F        # q, k, v, o, gate, up, down
    small = 2 * H + (qd + 2 * kd) * args.qkv_bias + 2 * args.head_dim * args.qk_norm
    root = args.vocab_size * H * (1 if args.tie_embeddings else 2) + H
    lora = (H + qd) + 2 * (H + kd) + (qd + H) + 2 * (H + F) + (F + H)  # r x (in + out) per adapted layer, r = 1
    return dict(linear=linear, block=linear + small, root=root, total=L * (linear + small) + root, lora=L * lora)


def _lora_targets(cfg) -> tuple:
    from grpo.lora import parse_targets  # torch, only where LoRA is asked for
    return parse_targets(getattr(cfg, "lora_target_modules", "all-linear"))


def act_bytes_per_token(args, c: int, lora_dropout: bool = False, lean_mlp: bool = True) -> int:
    """Bytes autograd keeps per token and layer in grpo/model.py's Block at compute width c (fp32: exactly
    what tests/test_backward.py counts). Each RMSNorm keeps its input and its output (the next layer's
    input), c each (the normalized value is recomputed in its backward); Qwen3's q and k norms their input
    over qd + kd channels (rotary after them keeps nothing of its input); q, k and v as attention reads
    them (qd + 2kd), attention's output and its o_proj input copy (2qd), gate and up (2F), and where the
    MLP's lean backward is off (under CPU autocast, or a LoRA down projection) silu(gate) and the product
    too (4F); fp32 statistics (each norm's rsqrt, attention's log-sum-exp per head). Under LoRA dropout
    each adapted layer keeps its dropped-out input and mask: 5H + qd + F channels, c + 1 bytes."""
    H, F, qd, kd = args.dim, args.ffn_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    norms = 2 * H * 2 * c + (qd + kd) * c * args.qk_norm
    rest = c * ((qd + 2 * kd) + 2 * qd + (2 if lean_mlp else 4) * F)
    stats = 4 * (2 + args.n_heads + (args.n_heads + args.n_kv_heads) * args.qk_norm)
    return norms + rest + stats + (5 * H + qd + F) * (c + 1) * lora_dropout


@dataclass
class Plan:
    phases: dict            # phase -> [(term, bytes, formula)]
    memory: int             # bytes on the device (a rank's share of the machine's RAM on a CPU)
    world: int
    device: str
    notes: list = field(default_factory=list)

    def total(self, phase: str) -> int:
        s = sum(b for _, b, _ in self.phases[phase])
        return int(s * (1 + GPU_MARGIN)) if self.device == "cuda" else s

    @property
    def peak(self) -> tuple[str, int]:
        return max(((p, self.total(p)) for p in self.phases), key=lambda x: x[1])

    @property
    def fits(self) -> bool:
        return self.peak[1] <= self.memory

    def summary(self) -> str:
        phase, peak = self.peak
        room = (self.memory - peak) / GIB
        verdict = f"fits, with {room:.1f} GiB to spare" if room >= 0 else f"does not fit ({-room:.1f} GiB over)"
        return (f"memory plan: peak {peak / GIB:.1f} GiB per rank ({phase}) of {self.memory / GIB:.1f} GiB, "
                f"{self.world} rank(s): {verdict}")

    def table(self) -> str:
        lines = ["| phase | term | GiB | formula |", "|---|---|---|---|"]
        for phase, terms in self.phases.items():
            for name, b, formula in terms:
                lines.append(f"| {phase} | {name} | {b / GIB:.2f} | {formula} |")
            margin = f" (+{GPU_MARGIN:.0%} allocator margin)" if self.device == "cuda" else ""
            lines.append(f"| {phase} | **total{margin}** | **{self.total(phase) / GIB:.2f}** | |")
        return "\n".join(lines + [self.summary()])


def memory_plan(args, cfg, world: int = 1, device: str = "cuda", memory_gib: float | None = None,
                extra: list = ()) -> Plan:
    """The plan for a run of `cfg` (grpo.config.Config or a recipe's) on `world` ranks of `device`. `extra`:
    (term, bytes, formula) a recipe holds through every phase (ProcessGRPO's frozen copy and its sampler)."""
    extra = list(extra)
    gpu = device == "cuda"
    n, W = counts(args), world
    c = compute_bytes(cfg, device)
    H, V, L = args.dim, args.vocab_size, args.n_layers
    # CPU autocast_bf16 ("auto" counted as on: the bound either way, a bf16 decode copy plus autocast's casts
    # weigh what an fp32 copy does): the decode copy's matmul weights in bf16, and autocast's bf16 casts of the
    # blocks' weights, cached through each sampler call and each forward + backward
    autocast = not gpu and str(cfg.autocast_bf16).lower() in ("true", "1", "auto")
    casts = [("autocast's bf16 weight casts", 2 * L * n["linear"], "2 x the blocks' linear weights")] if (
        autocast and not cfg.use_peft) else []  # a LoRA base stored in bf16 needs none
    fsdp = gpu or W > 1                                           # one CPU process runs without FSDP
    state, notes = [], []
    if cfg.use_peft:  # the frozen base in the compute dtype, bf16 under CPU autocast (grpo.lora.cast_base)
        trained = n["lora"] * cfg.lora_r
        base = 2 if autocast else c
        state.append(("frozen base, sharded", base * n["total"] // W, f"{base} x parameters / ranks"))
        state.append(("LoRA adapters, fp32 master", 4 * trained // W, "4 x r x (in + out) x 7 x layers / ranks"))
    else:
        trained = n["total"]
        state.append(("master weights, fp32, sharded", 4 * trained // W, "4 x parameters / ranks"))
    state.append(("AdamW's two states, fp32", 8 * trained // W, "2 x 4 x trained parameters / ranks"))
    if cfg.beta > 0 and not cfg.use_peft:  # under LoRA the reference is the base with adapters off
        state.append(("KL reference, fp32, sharded", 4 * n["total"] // W, "4 x parameters / ranks"))
    memory = int((memory_gib or 0) * GIB) or _default_memory(device, W)
    fixed = [("CUDA context", int(CUDA_CONTEXT), "stated")] if gpu else [
        ("runtime (Python, torch, transformers)", int(CPU_RUNTIME), "stated: measured resident size")]

    # the sampler (grpo.decode.DecodeWeights): a copy of every weight, its matmuls in their dtype (bf16 under
    # autocast); on a CPU in the weights' own dtype the GEMMs' weights and the LM head, packed for oneDNN (the
    # norms and the embedding read in place)
    mm = 2 if (gpu or autocast or c == 2) else 4
    packed = not gpu and mm == c
    bias = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim * args.qkv_bias  # stored with the matmuls
    rest = V * H * c if packed else L * (n["block"] - n["linear"] - bias) * c + n["root"] * c
    decode_copy = L * (n["linear"] + bias) * mm + rest
    gathered = c * n["total"] if fsdp else 0                      # FSDP's unsharded compute-dtype weights
    kv_bytes = c                                                  # the cache takes the sampler weights' dtype

    def sampling(rows: int, length: int) -> list:
        S, slot = slot_bytes(args, length, kv_bytes)
        if gpu:  # the sampler's default budget: half of what is free when build() makes it (no AdamW state yet)
            loaded = sum(b for name, b, _ in state + fixed if not name.startswith("AdamW"))
            budget = int(cfg.kv_budget_gb * GIB) or (memory - loaded - gathered) // 2
            slots = max(1, min(cfg.gen_batch, budget // slot))     # gen_batch slots, within the budget
        else:  # eager decode: the call's rows, within the budget (2 GiB by default on a CPU)
            slots = max(1, min(cfg.gen_batch, rows, (int(cfg.kv_budget_gb * GIB) or 2 * GIB) // slot))
        prefill = (8192 if gpu else 2048) * (3 * H + args.n_heads * args.head_dim + 3 * args.ffn_dim) * c
        terms = [("KV cache", slots * slot, f"{slots} slots x {S} positions x 2 x layers x kv heads x head dim x {kv_bytes} B"),
                 ("decode copy of the weights", decode_copy, "the blocks' GEMM weights and the LM head, packed for oneDNN" if packed
                  else "every weight once, matmuls in their dtype"),
                 ("sampler workspace", slots * V * 4 * 2 + prefill,
                  "fp32 logits and noise of a step (slots x V x 8) + a prefill chunk's activations")]
        if gathered:
            terms.insert(0, ("gathered weights (FSDP, compute dtype)", gathered, "compute bytes x parameters"))
        return terms + casts

    rows = max(1, cfg.prompts_per_step * cfg.num_generations // W)
    phases = {"rollouts": fixed + state + sampling(rows, cfg.max_prompt_length + cfg.max_completion_length) + extra}
    eval_len = getattr(cfg, "eval_max_completion_length", 0) or cfg.max_completion_length
    eval_rows = max(1, getattr(cfg, "eval_limit", 0) * max(1, getattr(cfg, "eval_n", 1)) // W)
    if getattr(cfg, "eval_limit", 0):
        phases["eval"] = fixed + state + sampling(eval_rows, cfg.max_prompt_length + eval_len) + extra

    # the update: one packed micro-batch of T tokens through forward and backward
    T = cfg.micro_batch_tokens
    lora_down = cfg.use_peft and "down_proj" in _lora_targets(cfg)  # then the MLP runs LoRA's forward
    per_layer = act_bytes_per_token(args, c, cfg.use_peft and cfg.lora_dropout > 0,
                                    lean_mlp=not (lora_down or autocast))
    if cfg.gradient_checkpointing:  # each block keeps its input; one block's activations live in its recompute
        acts, formula = T * (L * H * c + per_layer), f"{T} tokens x (layers x H x {c} B + one block's {per_layer} B)"
    else:
        acts, formula = T * L * per_layer, f"{T} tokens x layers x {per_layer} B a token and layer"
    chunk = min(V, max(256, (2**26 if gpu else 2**23) // max(T, 1) // 256 * 256))  # grpo.kernels' vocab chunk
    update = [("gradients, fp32, sharded", 4 * trained // W, "4 x trained parameters / ranks"),
              ("activations of one micro-batch", acts, formula),
              ("log-probs' vocabulary chunk", 2 * T * chunk * 4, f"logits and their gradient, {T} x {chunk} fp32"),
              ("root's input and output", T * H * (c + 4) + T * 4 * 3, "embedding out, final norm out, per-token stats"),
              ("a layer's backward temporaries", 4 * T * args.ffn_dim * c, f"4 x {T} tokens x F x {c} B: the MLP's")]
    if fsdp:  # two blocks gathered at a time (prefetch), the root kept through backward, their unreduced grads
        update.append(("FSDP's gathered blocks, root and their grads", 2 * c * (2 * n["block"] + n["root"]),
                       "2 x compute bytes x (2 blocks + root)"))
    if gpu and cfg.keep_kv_cache:  # kept through the update, so CUDA graphs survive it (their pool: the workspace)
        update += [t for t in sampling(rows, cfg.max_prompt_length + cfg.max_completion_length)
                   if t[0] in ("KV cache", "decode copy of the weights", "sampler workspace")]
    phases["update"] = fixed + state + update + casts + extra
    # before sharding, each rank loads the whole model in fp32 (its compute dtype under LoRA), then the reference
    load = [("the whole model as loaded, before sharding", (c if cfg.use_peft else 4) * n["total"],
             "bytes x parameters, on every rank")]
    phases = {"load": fixed + load + extra, **phases}
    if not gpu:
        notes.append("CPU: the sampler's cache and decode copy are freed after each rollout (release())")
    return Plan(phases, memory, W, device, notes)


def compute_bytes(cfg, device: str) -> int:
    """The compute dtype's bytes: bf16 on a GPU (and where asked for), fp32 on a CPU."""
    return 2 if device == "cuda" or cfg.dtype == "bfloat16" else 4


def slot_bytes(args, length: int, c: int) -> tuple[int, int]:
    """(positions, bytes) of one sampler row of `length` tokens: rounded up to 64 positions as the sampler
    sizes it (Sampler._start), k and v of every layer at c bytes (KVCache.slot_bytes)."""
    import torch
    from grpo.kv_cache import KVCache
    S = -(-length // 64) * 64
    return S, KVCache.slot_bytes(args, S, torch.bfloat16 if c == 2 else torch.float32)


def frozen_copy_terms(args, c: int, slots: int, length: int, budget: int) -> list:
    """A second model a recipe holds through the run with its own sampler (ProcessGRPO's frozen copy), as
    memory_plan's `extra`: its weights and decode copy at c bytes, and its KV cache of `slots` rows of
    `length` positions within `budget` bytes."""
    n = counts(args)["total"]
    _, slot = slot_bytes(args, length, c)
    kv = max(1, min(slots, budget // slot)) * slot
    return [("frozen copy's weights", c * n, f"{c} x parameters"),
            ("frozen copy's decode copy", c * n, f"{c} x parameters"),
            ("frozen copy's KV cache", kv, f"{kv // slot} slots x {length} positions, within its budget")]


def _default_memory(device: str, world: int) -> int:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_properties(0).total_memory
    return memory_of_cpu(world)


def memory_of_cpu(ranks: int = 1) -> int:
    """This machine's RAM (MemTotal), shared by `ranks` processes; 64 GiB where /proc is not there."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:")) // ranks
    except (OSError, StopIteration):
        return (64 * GIB) // ranks


# what a run sizes from the plan where the recipe, its YAML and its command line leave them (grpo.config's
# profile "auto" on a GPU), and the values it tries, largest first
SIZED = ("gen_batch", "kv_budget_gb", "micro_batch_tokens", "gradient_checkpointing")
GEN_BATCHES = (256, 128, 64, 32, 16, 8)
MICRO_BATCHES = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 4096, 2048)
FAST_MICRO_BATCH = 8192  # below it a GPU's update GEMMs run short of rows: checkpointing is the better trade


def size(args, cfg, world: int, device: str, memory_gib: float | None, extra: list = (),
         free=SIZED) -> dict:
    """Values for the `free` fields of cfg (of SIZED) with which the plan fits, chosen in two steps:
    - the sampler: the largest gen_batch (no more than a call's rows: the step's or an eval's per rank,
      rounded up to a power of two) that leaves the update room for a FAST_MICRO_BATCH with checkpointing
      (with keep_kv_cache the cache stays through the update), else any update; its KV budget what gen_batch
      rows of training's longest sequence hold (an eval's longer rows take fewer slots of the same budget,
      at least one; a GPU keeps all gen_batch slots through the update with keep_kv_cache, so a step of
      fewer rows than an eval's holds the eval's slots);
    - the update: the largest micro-batch without gradient checkpointing, down to FAST_MICRO_BATCH tokens,
      else the largest with it; never below the longest sequence (one must fit a micro-batch).
    Where nothing fits, the smallest of each: the run's refusal then names what else would fit."""
    free = [f for f in SIZED if f in free]
    if not free:
        return {}
    longest = cfg.max_prompt_length + cfg.max_completion_length
    eval_len = cfg.max_prompt_length + (getattr(cfg, "eval_max_completion_length", 0) or cfg.max_completion_length)
    c = compute_bytes(cfg, device)
    slot, eval_slot = slot_bytes(args, longest, c)[1], slot_bytes(args, eval_len, c)[1]
    rows = max(cfg.prompts_per_step * cfg.num_generations // world,
               getattr(cfg, "eval_limit", 0) * max(1, getattr(cfg, "eval_n", 1)) // world, 1)
    batches = [g for g in GEN_BATCHES if g < 2 * rows] or [GEN_BATCHES[-1]]
    if "kv_budget_gb" not in free and cfg.kv_budget_gb:  # the user's budget: no more rows than it holds
        held = int(cfg.kv_budget_gb * GIB) // slot
        batches = [g for g in batches if g <= held] or [max(1, min(held, GEN_BATCHES[-1]))]
    micro = [m for m in MICRO_BATCHES if m >= longest] or [-(-longest // 1024) * 1024]
    updates = [(False, m) for m in micro if m >= FAST_MICRO_BATCH] + [(True, m) for m in micro]  # (checkpointing, tokens)
    if "gen_batch" not in free:
        batches = [cfg.gen_batch]
    if "gradient_checkpointing" not in free:
        updates = [(ckpt, m) for ckpt, m in updates if ckpt == cfg.gradient_checkpointing]
    if "micro_batch_tokens" not in free:
        updates = list(dict.fromkeys((ckpt, cfg.micro_batch_tokens) for ckpt, _ in updates))

    def sized(g: int, update: tuple) -> dict:
        kv = -(-max(g * slot, eval_slot) // (GIB // 4)) / 4  # GiB, rounded up to a quarter
        values = dict(zip(SIZED, (g, kv, update[1], update[0])))
        return {k: values[k] for k in free}

    def fits(g: int, update: tuple) -> bool:
        return memory_plan(args, dataclasses.replace(cfg, **sized(g, update)), world, device, memory_gib, extra).fits

    floor = next((u for u in reversed(updates) if u[1] >= FAST_MICRO_BATCH), updates[-1])
    g = next((g for g in batches if fits(g, floor)), None) or next(
        (g for g in batches if fits(g, updates[-1])), batches[-1])
    return sized(g, next((u for u in updates if fits(g, u)), updates[-1]))


def what_fits(args, cfg, world: int, device: str, memory_gib: float | None, extra: list = ()) -> list[tuple[str, int, bool]]:
    """Changes that lower the peak, each with its new peak and whether it fits: more GPUs, gradient
    checkpointing, a smaller micro-batch or gen_batch, LoRA, and keep_kv_cache false."""
    tries = []
    longest = cfg.max_prompt_length + cfg.max_completion_length
    if device == "cuda" and world < 8:
        tries.append((f"{min(8, 2 * world)} GPUs", cfg, min(8, 2 * world)))
    if not cfg.gradient_checkpointing:
        tries.append(("--gradient_checkpointing true", dataclasses.replace(cfg, gradient_checkpointing=True), world))
    if cfg.micro_batch_tokens // 2 >= longest:  # a sequence must fit one micro-batch
        tries.append((f"--micro_batch_tokens {cfg.micro_batch_tokens // 2}",
                      dataclasses.replace(cfg, micro_batch_tokens=cfg.micro_batch_tokens // 2), world))
    if cfg.gen_batch > 1:
        tries.append((f"--gen_batch {cfg.gen_batch // 2}", dataclasses.replace(cfg, gen_batch=cfg.gen_batch // 2), world))
    if not cfg.use_peft:
        tries.append(("--use_peft (LoRA r 16)", dataclasses.replace(cfg, use_peft=True, lora_r=16), world))
    if device == "cuda" and cfg.keep_kv_cache:
        tries.append(("--keep_kv_cache false", dataclasses.replace(cfg, keep_kv_cache=False), world))
    out = []
    for what, c, w in tries:
        p = memory_plan(args, c, w, device, memory_gib, extra)
        out.append((what, p.peak[1], p.fits))
    return out

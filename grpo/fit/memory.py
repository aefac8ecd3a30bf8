"""The memory plan: what each rank holds at the peak of each phase of a run, before anything loads.

    plan = memory_plan(args, cfg, world=8, device="cuda", memory_gib=48)   # args: grpo.models.model.ModelArgs
    print(plan.table()); plan.fits; plan.peak
    python -m grpo.cli.plan recipes/calculator_qwen25_3b.py --gpus 8 --gpu "RTX 6000 Ada"   # grpo/cli/plan.py

A run's memory peaks in one of its phases:
- load: each rank reads the whole model before sharding it (and with beta > 0 the reference after it);
- rollouts: the sampler over the gathered weights (FSDP's unsharded compute-dtype copy), its resident
  decode copy (grpo/engine/decode.py) and its KV cache, sized for the step's rows;
- eval: the same with the eval's rows and lengths (an eval's completions may be longer);
- update: gradients, the activations of one packed micro-batch and the fused log-prob's vocabulary chunk;
- step: the optimizer step after the last backward: the gradients, and AdamW's temporary (on CUDA its
  default foreach implementation holds sqrt(exp_avg_sq) for every trained parameter at once).
Through all of them: the sharded master weights and AdamW's two states (and the KL reference's weights,
in the compute dtype, when beta > 0); with keep_kv_cache on a GPU, the KV cache and the decode copy stay
through the update and the step.

Every term is a named line whose formula is in the comment where it is computed. What the plan does
not see: the allocator's fragmentation (a stated margin: 10% on a GPU), the CUDA context (a stated
constant), and on a CPU the process's runtime (Python, torch, transformers: a stated constant, measured).
Activations are counted per token and layer from the tensors autograd keeps in grpo/models/model.py's Block
(tests/test_memory.py measures them).
"""
import dataclasses
import itertools
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
# Qwen3.5's hybrid model (its VLM checkpoint's text_config): 18 Gated DeltaNet and 6 attention layers
KNOWN["Qwen/Qwen3.5-0.8B"] = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
    num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
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
    when untied, final norm), the whole model, and the LoRA adapters of all seven linear layers per
    rank r=1."""
    if args.hybrid:  # Qwen3.5: two kinds of layer
        return hybrid_counts(args)
    H, F, L, qd, kd = (args.dim, args.ffn_dim, args.n_layers, args.n_heads * args.head_dim,
                       args.n_kv_heads * args.head_dim)
    linear = H * qd + 2 * H * kd + qd * H + 3 * H * F        # q, k, v, o, gate, up, down
    small = 2 * H + (qd + 2 * kd) * args.qkv_bias + 2 * args.head_dim * args.qk_norm
    root = args.vocab_size * H * (1 if args.tie_embeddings else 2) + H
    # r x (in + out) per adapted layer, r = 1
    lora = (H + qd) + 2 * (H + kd) + (qd + H) + 2 * (H + F) + (F + H)
    return dict(linear=linear, block=linear + small, root=root, total=L * (linear + small) + root,
                lora=L * lora)


def _lora_targets(cfg) -> tuple:
    from grpo.config import parse_targets
    return parse_targets(getattr(cfg, "lora_target_modules", "all-linear"))


def act_bytes_per_token(args, c: int, lora_dropout: bool = False, lean_mlp: bool = True) -> int:
    """Bytes autograd keeps per token and layer in grpo/models/model.py's Block at compute width c (fp32:
    exactly what tests/test_backward.py counts). Each RMSNorm keeps its input and its output (the next
    layer's input), c each (the normalized value is recomputed in its backward); Qwen3's q and k norms their
    input over qd + kd channels (rotary after them keeps nothing of its input); q, k and v as attention
    reads them (qd + 2kd), attention's output and its o_proj input copy (2qd), gate and up (2F), and where
    the MLP's lean backward is off (under CPU autocast, or a LoRA down projection) silu(gate) and the
    product too (4F); fp32 statistics (each norm's rsqrt, attention's log-sum-exp per head). Under LoRA
    dropout each adapted layer keeps its dropped-out input and mask: 5H + qd + F channels, c + 1 bytes."""
    if args.hybrid:  # Qwen3.5: the mean over its two kinds of layer (LoRA dropout's inputs not counted)
        return hybrid_act_bytes(args, c, lean_mlp)
    H, F, qd, kd = args.dim, args.ffn_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    norms = 2 * H * 2 * c + (qd + kd) * c * args.qk_norm
    rest = c * ((qd + 2 * kd) + 2 * qd + (2 if lean_mlp else 4) * F)
    stats = 4 * (2 + args.n_heads + (args.n_heads + args.n_kv_heads) * args.qk_norm)
    return norms + rest + stats + (5 * H + qd + F) * (c + 1) * lora_dropout


def hybrid_counts(args) -> dict:
    """counts() of a Qwen3.5 hybrid model (grpo/models/qwen35.py): attention layers whose q_proj is
    twice as wide (the output gate), linear layers with five projections, a depthwise conv and
    per-head parameters (grpo/models/deltanet.py). `linear` is the mean over layers; `block` the
    larger kind (FSDP gathers whole blocks)."""
    H, F, L, V, la = args.dim, args.ffn_dim, args.n_layers, args.vocab_size, args.linear
    qd, kd, C, vd, Hv = (args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, la.conv_dim,
                         la.v_heads * la.v_dim, la.v_heads)
    n_attn = args.layer_types.count("full_attention")
    n_lin = L - n_attn
    # q (with gate), k, v, o; qkv, z, out, b, a
    attn, lin = 3 * H * qd + 2 * H * kd, H * C + 2 * H * vd + 2 * H * Hv
    small_attn, small_lin = 2 * H + 2 * args.head_dim, 2 * H + C * la.conv_kernel + 2 * Hv + la.v_dim
    linear = n_attn * attn + n_lin * lin + 3 * L * H * F
    root = V * H * (1 if args.tie_embeddings else 2) + H
    lora = (n_attn * ((H + 2 * qd) + 2 * (H + kd) + (qd + H))
            + n_lin * ((H + C) + 2 * (H + vd) + 2 * (H + Hv))
            + L * (2 * (H + F) + (F + H)))  # r x (in + out) of every linear layer, r = 1
    block = max(attn + small_attn, lin + small_lin) + 3 * H * F
    return dict(linear=linear // L, block=block, root=root,
                total=linear + n_attn * small_attn + n_lin * small_lin + root, lora=lora)


def hybrid_act_bytes(args, c: int, lean_mlp: bool = True) -> int:
    """act_bytes_per_token of a Qwen3.5 hybrid model: the mean over its layers of what autograd keeps a token.
    Both kinds: two (1 + w) RMSNorms (input, its fp32 product, the linears' input: 3H each and a
    statistic) and the MLP (2F, or 4F without the lean backward). An attention layer: q_proj's output
    with the gate (2qd), q and k before and after their norms (qd + 2kd + kd), SDPA's q, k, v and
    output (2qd + 2kd), the gate's sigmoid and the gated output twice (3qd); statistics per head. A
    linear layer (grpo/models/deltanet.py's chunked form, C_c = its chunk size): the conv's input and
    output and SiLU's (3C), the gated norm's five (Hv, Dv) tensors and out_proj's input (6 vd), and in
    fp32 for each value head the chunk's five (C_c x C_c) matrices (5 C_c a token), nine Dk- and four
    Dv-wide tensors, four scalars and a state per chunk (Dk Dv / C_c). Measured in
    tests/test_qwen35.py; the rule's part (fp32 whatever c) is most of it at Qwen3.5's shapes."""
    H, F, L, la = args.dim, args.ffn_dim, args.n_layers, args.linear
    qd, kd, C, vd, Hv, Cc = (args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, la.conv_dim,
                             la.v_heads * la.v_dim, la.v_heads, 64)
    both = 2 * (3 * H * c + 4) + (2 if lean_mlp else 4) * F * c
    attn = c * (8 * qd + 4 * kd) + 4 * (2 * args.n_heads + args.n_kv_heads)
    rule = 4 * Hv * (5 * Cc + 9 * la.k_dim + 4 * la.v_dim + 4) + 4 * Hv * la.k_dim * la.v_dim // Cc
    lin = c * (3 * C + 6 * vd) + 4 * (4 * Hv + 2 * la.k_heads) + rule
    n_attn = args.layer_types.count("full_attention")
    return both + (n_attn * attn + (L - n_attn) * lin) // L


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
        verdict = (f"fits, with {room:.1f} GiB to spare" if room >= 0
                   else f"does not fit ({-room:.1f} GiB over)")
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
    # weigh what an fp32 copy does): the decode copy's matmul weights in bf16, and autocast's bf16
    # casts of the blocks' weights, cached through each sampler call and each forward + backward
    autocast = not gpu and str(cfg.autocast_bf16).lower() in ("true", "1", "auto")
    casts = [("autocast's bf16 weight casts", 2 * L * n["linear"], "2 x the blocks' linear weights")] if (
        autocast and not cfg.use_peft) else []  # a LoRA base stored in bf16 needs none
    fsdp = gpu or W > 1                                           # one CPU process runs without FSDP
    state, notes = [], []
    # the frozen base in the compute dtype, bf16 under CPU autocast (grpo.models.lora.cast_base)
    if cfg.use_peft:
        trained = n["lora"] * cfg.lora_r
        base = 2 if autocast else c
        state.append(("frozen base, sharded", base * n["total"] // W, f"{base} x parameters / ranks"))
        state.append(("LoRA adapters, fp32 master", 4 * trained // W,
                      "4 x r x (in + out) x 7 x layers / ranks"))
    else:
        trained = n["total"]
        state.append(("master weights, fp32, sharded", 4 * trained // W, "4 x parameters / ranks"))
    state.append(("AdamW's two states, fp32", 8 * trained // W, "2 x 4 x trained parameters / ranks"))
    # the KL reference (beta > 0) is frozen: it is loaded in the dtype its forward computes in (bf16 on a GPU,
    # FSDP's param_dtype), not as fp32 master weights; one CPU process, with no FSDP to cast it, keeps fp32.
    # Under LoRA the reference is the base with the adapters off: nothing more
    ref = c if fsdp else 4
    if cfg.beta > 0 and not cfg.use_peft:
        state.append((f"KL reference, {'bf16' if ref == 2 else 'fp32'}, sharded", ref * n["total"] // W,
                      f"{ref} x parameters / ranks"))
    memory = int((memory_gib or 0) * GIB) or _default_memory(device, W)
    fixed = [("CUDA context", int(CUDA_CONTEXT), "stated")] if gpu else [
        ("runtime (Python, torch, transformers)", int(CPU_RUNTIME), "stated: measured resident size")]

    # the sampler (grpo.engine.decode.DecodeWeights): a copy of every weight, its matmuls in their
    # dtype (bf16 under autocast); on a CPU in the weights' own dtype the GEMMs' weights and the LM
    # head, packed for oneDNN (the norms and the embedding read in place)
    mm = 2 if (gpu or autocast or c == 2) else 4
    packed = not gpu and mm == c
    bias = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim * args.qkv_bias  # stored with the matmuls
    rest = V * H * c if packed else L * (n["block"] - n["linear"] - bias) * c + n["root"] * c
    decode_copy = L * (n["linear"] + bias) * mm + rest
    if args.hybrid:  # no copy: a hybrid model decodes through its own forward (grpo/engine/model_decode.py)
        decode_copy = 0
    gathered = c * n["total"] if fsdp else 0                      # FSDP's unsharded compute-dtype weights
    kv_bytes = c                                                  # the cache takes the sampler weights' dtype

    def sampling(rows: int, length: int) -> list:
        S, slot = slot_bytes(args, length, kv_bytes)
        # the sampler's default budget: half of what is free when build() makes it (no AdamW state yet)
        if gpu:
            loaded = sum(b for name, b, _ in state + fixed if not name.startswith("AdamW"))
            budget = int(cfg.kv_budget_gb * GIB) or (memory - loaded - gathered) // 2
            slots = max(1, min(cfg.gen_batch, budget // slot))     # gen_batch slots, within the budget
        else:  # eager decode: the call's rows, within the budget (2 GiB by default on a CPU)
            slots = max(1, min(cfg.gen_batch, rows, (int(cfg.kv_budget_gb * GIB) or 2 * GIB) // slot))
        prefill = (8192 if gpu else 2048) * (3 * H + args.n_heads * args.head_dim + 3 * args.ffn_dim) * c
        terms = [("KV cache", slots * slot,
                  f"{slots} slots x {S} positions x 2 x layers x kv heads x head dim x {kv_bytes} B"),
                 ("decode copy of the weights", decode_copy,
                  "the blocks' GEMM weights and the LM head, packed for oneDNN" if packed
                  else "every weight once, matmuls in their dtype"),
                 ("sampler workspace", slots * V * 4 * 2 + prefill,
                  "fp32 logits and noise of a step (slots x V x 8) + a prefill chunk's activations")]
        if gathered:
            terms.insert(0, ("gathered weights (FSDP, compute dtype)", gathered,
                             "compute bytes x parameters"))
        return terms + casts

    rows = max(1, cfg.prompts_per_step * cfg.num_generations // W)
    phases = {"rollouts": fixed + state + sampling(rows, cfg.max_prompt_length + cfg.max_completion_length)
              + extra}
    eval_len = getattr(cfg, "eval_max_completion_length", 0) or cfg.max_completion_length
    eval_rows = max(1, getattr(cfg, "eval_limit", 0) * max(1, getattr(cfg, "eval_n", 1)) // W)
    if getattr(cfg, "eval_limit", 0):
        phases["eval"] = fixed + state + sampling(eval_rows, cfg.max_prompt_length + eval_len) + extra

    # the update: one packed micro-batch of T tokens through forward and backward
    T = cfg.micro_batch_tokens
    lora_down = cfg.use_peft and "down_proj" in _lora_targets(cfg)  # then the MLP runs LoRA's forward
    per_layer = act_bytes_per_token(args, c, cfg.use_peft and cfg.lora_dropout > 0,
                                    lean_mlp=not (lora_down or autocast))
    # each block keeps its input; one block's activations live in its recompute
    if cfg.gradient_checkpointing:
        acts, formula = (T * (L * H * c + per_layer),
                         f"{T} tokens x (layers x H x {c} B + one block's {per_layer} B)")
    else:
        acts, formula = T * L * per_layer, f"{T} tokens x layers x {per_layer} B a token and layer"
    chunk = min(V, max(256, (2**26 if gpu else 2**23) // max(T, 1) // 256 * 256))  # grpo.kernels' vocab chunk
    update = [("gradients, fp32, sharded", 4 * trained // W, "4 x trained parameters / ranks"),
              ("activations of one micro-batch", acts, formula),
              ("log-probs' vocabulary chunk", 2 * T * chunk * 4,
               f"logits and their gradient, {T} x {chunk} fp32"),
              ("root's input and output", T * H * (c + 4) + T * 4 * 3,
               "embedding out, final norm out, per-token stats"),
              ("a layer's backward temporaries", 4 * T * args.ffn_dim * c,
               f"4 x {T} tokens x F x {c} B: the MLP's")]
    # two blocks gathered at a time (prefetch), the root kept through backward, their unreduced grads
    if fsdp:
        update.append(("FSDP's gathered blocks, root and their grads", 2 * c * (2 * n["block"] + n["root"]),
                       "2 x compute bytes x (2 blocks + root)"))
    # kept through the update, so CUDA graphs survive it (their pool: the workspace)
    if gpu and cfg.keep_kv_cache:
        update += [t for t in sampling(rows, cfg.max_prompt_length + cfg.max_completion_length)
                   if t[0] in ("KV cache", "decode copy of the weights", "sampler workspace")]
    phases["update"] = fixed + state + update + casts + extra
    # the optimizer step, after the last micro-batch's backward (its activations freed): the gradients and
    # AdamW's temporary. On CUDA AdamW's default (foreach) holds sqrt(exp_avg_sq) of every trained parameter
    # at once (torch.optim.adam._multi_tensor_adam's exp_avg_sq_sqrt): 4 bytes a trained parameter, the
    # step that decides whether the 3B calculator's full fine-tune fits one H100 (bench/RESULTS.md has the
    # figures). Counted, not avoided: fused=True would not hold it and foreach=False would hold one tensor's
    # worth, but the trainer keeps torch's default, the implementation its GPU runs were measured with (fused
    # under FSDP2's DTensor parameters has not run on a GPU here). On a CPU AdamW runs per tensor (no foreach
    # there): sqrt(exp_avg_sq) and its quotient, two temporaries the size of the largest trained tensor
    if gpu:
        temp, formula = 4 * trained // W, "4 x trained parameters / ranks (foreach: all tensors at once)"
    else:
        largest = (max(H, args.ffn_dim, args.n_heads * args.head_dim) * cfg.lora_r if cfg.use_peft
                   else max(V * H, H * args.ffn_dim))
        temp, formula = 2 * 4 * largest, "2 x 4 x the largest trained tensor (per-tensor AdamW)"
    step = [("gradients, fp32, sharded", 4 * trained // W, "4 x trained parameters / ranks"),
            ("AdamW's step temporary, fp32", temp, formula)]
    if gpu and cfg.keep_kv_cache:
        step += [t for t in update if t[0] in ("KV cache", "decode copy of the weights", "sampler workspace")]
    phases["step"] = fixed + state + step + casts + extra
    # before sharding, each rank loads the whole model in fp32 (its compute dtype under LoRA); then, with
    # beta > 0, the reference whole in its dtype beside the policy's shards: the larger of the two moments
    load = [("the whole model as loaded, before sharding", (c if cfg.use_peft else 4) * n["total"],
             "bytes x parameters, on every rank")]
    if cfg.beta > 0 and not cfg.use_peft and 4 * n["total"] // W + ref * n["total"] > load[0][1]:
        load = [("master weights, fp32, sharded", 4 * n["total"] // W, "4 x parameters / ranks"),
                ("the KL reference as loaded, before sharding", ref * n["total"],
                 f"{ref} x parameters, on every rank")]
    phases = {"load": fixed + load + extra, **phases}
    if not gpu:
        notes.append("CPU: the sampler's cache and decode copy are freed after each rollout (release())")
    return Plan(phases, memory, W, device, notes)


def compute_bytes(cfg, device: str) -> int:
    """The compute dtype's bytes: bf16 on a GPU (and where asked for), fp32 on a CPU."""
    return 2 if device == "cuda" or cfg.dtype == "bfloat16" else 4


def slot_bytes(args, length: int, c: int) -> tuple[int, int]:
    """(positions, bytes) of one sampler row of `length` tokens: rounded up to 64 positions as the sampler
    sizes it (Scheduler.start), k and v of every layer at c bytes (KVCache.slot_bytes)."""
    import torch

    from grpo.engine.hybrid_cache import HybridCache
    from grpo.engine.kv_cache import KVCache
    S = -(-length // 64) * 64
    # a hybrid model's rows also hold the linear layers' state
    cache = HybridCache if args.hybrid else KVCache
    return S, cache.slot_bytes(args, S, torch.bfloat16 if c == 2 else torch.float32)


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
    eval_len = cfg.max_prompt_length + (getattr(cfg, "eval_max_completion_length", 0)
                                        or cfg.max_completion_length)
    c = compute_bytes(cfg, device)
    slot, eval_slot = slot_bytes(args, longest, c)[1], slot_bytes(args, eval_len, c)[1]
    rows = max(cfg.prompts_per_step * cfg.num_generations // world,
               getattr(cfg, "eval_limit", 0) * max(1, getattr(cfg, "eval_n", 1)) // world, 1)
    batches = [g for g in GEN_BATCHES if g < 2 * rows] or [GEN_BATCHES[-1]]
    if "kv_budget_gb" not in free and cfg.kv_budget_gb:  # the user's budget: no more rows than it holds
        held = int(cfg.kv_budget_gb * GIB) // slot
        batches = [g for g in batches if g <= held] or [max(1, min(held, GEN_BATCHES[-1]))]
    micro = [m for m in MICRO_BATCHES if m >= longest] or [-(-longest // 1024) * 1024]
    # (checkpointing, tokens)
    updates = [(False, m) for m in micro if m >= FAST_MICRO_BATCH] + [(True, m) for m in micro]
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
        return memory_plan(args, dataclasses.replace(cfg, **sized(g, update)), world, device, memory_gib,
                           extra).fits

    floor = next((u for u in reversed(updates) if u[1] >= FAST_MICRO_BATCH), updates[-1])
    g = next((g for g in batches if fits(g, floor)), None) or next(
        (g for g in batches if fits(g, updates[-1])), batches[-1])
    return sized(g, next((u for u in updates if fits(g, u)), updates[-1]))


def what_fits(args, cfg, world: int, device: str, memory_gib: float | None,
              extra: list = ()) -> list[tuple[str, int, bool]]:
    """Changes that lower the peak, each with its new peak and whether it fits: more GPUs, gradient
    checkpointing, a smaller micro-batch or gen_batch, LoRA, and keep_kv_cache false. A change that does not
    lower the peak is never offered. Where no change alone fits, the combinations that fit follow ("a + b"),
    of as few changes as any fitting one needs, the lowest peaks first (at most MAX_COMBINATIONS)."""
    peak = memory_plan(args, cfg, world, device, memory_gib, extra).peak[1]
    singles = []
    for what, group, change in changes(cfg, world, device):
        c, w = change(cfg, world)
        p = memory_plan(args, c, w, device, memory_gib, extra)
        if p.peak[1] < peak:
            singles.append((what, group, change, p.peak[1], p.fits))
    out = [(what, p, fits) for what, _, _, p, fits in singles]
    if any(fits for *_, fits in out):
        return out
    for k in range(2, len(singles) + 1):
        found = []
        for combo in itertools.combinations(singles, k):
            if len({group for _, group, *_ in combo}) < k:
                continue  # two GPU counts
            c, w = cfg, world
            for _, _, change, _, _ in combo:
                c, w = change(c, w)
            p = memory_plan(args, c, w, device, memory_gib, extra)
            if p.fits:
                found.append((" + ".join(what for what, *_ in combo), p.peak[1], True))
        if found:
            return out + sorted(found, key=lambda x: x[1])[:MAX_COMBINATIONS]
    return out


def fixes_text(fixes: list) -> str:
    """what_fits' answer as lines: the changes alone, then the combinations that fit where none alone does."""
    line = lambda what, peak, fits: (  # noqa: E731
        f"  {what}: peak {peak / GIB:.1f} GiB{'  fits' if fits else ''}")
    alone, together = [f for f in fixes if " + " not in f[0]], [f for f in fixes if " + " in f[0]]
    lines = ["what would fit (each change alone):"] + [line(*f) for f in alone]
    if together:
        lines += ["...or together (no change alone fits):"] + [line(*f) for f in together]
    elif not any(fits for *_, fits in alone):
        lines.append("  none of these fits, alone or together: a GPU with more memory")
    return "\n".join(lines)


MAX_COMBINATIONS = 5


def changes(cfg, world: int, device: str) -> list[tuple[str, str, object]]:
    """(flag, group, change): each change maps (cfg, world) to the changed pair, so that changes compose; a
    combination takes at most one change of a group (the GPU counts)."""
    longest = cfg.max_prompt_length + cfg.max_completion_length
    replace = lambda **kw: lambda c, w: (dataclasses.replace(c, **kw), w)  # noqa: E731
    out = [(f"{n} GPUs", "gpus", lambda c, w, n=n: (c, n)) for n in (2 * world, 4 * world, 8 * world)
           if device == "cuda" and n <= 8]
    if not cfg.gradient_checkpointing:
        out.append(("--gradient_checkpointing true", "ckpt", replace(gradient_checkpointing=True)))
    if cfg.micro_batch_tokens // 2 >= longest:  # a sequence must fit one micro-batch
        out.append((f"--micro_batch_tokens {cfg.micro_batch_tokens // 2}", "micro",
                    replace(micro_batch_tokens=cfg.micro_batch_tokens // 2)))
    if cfg.gen_batch > 1:
        out.append((f"--gen_batch {cfg.gen_batch // 2}", "gen", replace(gen_batch=cfg.gen_batch // 2)))
    if not cfg.use_peft:
        out.append(("--use_peft (LoRA r 16)", "lora", replace(use_peft=True, lora_r=16)))
    if device == "cuda" and cfg.keep_kv_cache:
        out.append(("--keep_kv_cache false", "kv", replace(keep_kv_cache=False)))
    return out

"""FSDP2 and checkpoints on CPU: two gloo ranks under torchrun against one process.

- Two ranks end with the weights, metrics and eval records of one process on the same global batch (the
  sampler's seeds are per global prompt, so the trajectories are the same).
- 4 steps straight == 2 steps, SIGTERM, resume, 2 steps: bitwise weights and metrics, with 1
  and with 2 ranks; SIGTERM writes a checkpoint and every rank exits 0.
- A SIGKILL during a checkpoint write leaves the previous checkpoint, which resumes bitwise.
- Unfinished, partial and corrupt checkpoint folders are skipped with a clear message.
- tests/dist_worker.py check_fsdp: sampling under dist.gathered() (one all-gather per module
  for a whole sampling call), the fused LM head inside the root's forward, tied embeddings,
  and the gathered export, which transformers loads.
- Ranks always agree: an exception on one rank ends every rank with its message
  (with torchrun, and for a stalled rank without it), the time budget is one clock, the
  checkpoint to resume is rank 0's choice, and the warm-start splits its batch over ranks.
Every run is a subprocess (plain `python` for 1 rank, torch.distributed.run for 2) on the toy
model, with beta > 0 (a sharded reference model), mu = 2, DAPO's global token count and
batch-std advantages, so that each distributed path is on.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from parallel import at_once
from toy import make_toy_dir

from grpo.infra.checkpoint import HANG_ENV, Checkpointer
from grpo.models.model import Transformer

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

WORKER = str(Path(__file__).with_name("dist_worker.py"))
TRAIN = dict(max_steps=4, prompts_per_step=4, num_generations=4, learning_rate=1e-3, max_prompt_length=16,
             max_completion_length=8, micro_batch_tokens=64, gen_batch=16, eval_limit=4, eval_n=2,
             eval_temperature=1.0, save_steps=0, max_grad_norm=1.0, tis_cap=2.0, beta=0.04, num_iterations=2,
             loss_type="dapo", scale_rewards="batch", adam_epsilon=1e-5)
TIMING = ("time/generate", "time/update", "tokens_per_s")


def free_port() -> int:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(world: int, out: Path, **kw) -> list[str]:
    args = [f"--{k}={v}" for k, v in {**TRAIN, "output_dir": out, **kw}.items()]
    if world == 1:
        return [sys.executable, WORKER, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
            f"--master_port={free_port()}", WORKER, *args]


def environ(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != HANG_ENV}
    return {**env, "OMP_NUM_THREADS": "1", **extra}  # two ranks share two cores


def launch(world: int, out: Path, timeout: int = 240, **kw) -> str:
    r = subprocess.run(command(world, out, **kw), env=environ(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout + r.stderr


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped) counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def weights(out: Path) -> dict:
    return load_file(out / "export" / "model.safetensors")


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in open(out / "metrics.jsonl")]


def assert_bitwise(a: Path, b: Path):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k}: max diff {(wa[k] - wb[k]).abs().max()}"
    assert metrics(a) == metrics(b)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    return make_toy_dir(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> str:
    """The toy with tied embeddings (SmolLM2, Qwen3-0.6B and Llama 3.2 tie theirs)."""
    path = Path(make_toy_dir(tmp_path_factory.mktemp("tied")))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(path / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def straight(toy, tied, tmp_path_factory):
    """straight(world) -> (output folder, log) of 4 uninterrupted steps; each world runs once, both at
    the first call (tests/parallel.py: the tests here use both)."""
    runs = {}

    def run(world: int, out: Path):
        return out, launch(world, out, model_path=toy, **({"check_fsdp": tied} if world == 2 else {}))

    def get(world: int):
        if not runs:
            outs = [tmp_path_factory.mktemp(f"straight{w}") for w in (1, 2)]
            runs.update(zip((1, 2), at_once(lambda: run(1, outs[0]), lambda: run(2, outs[1]))))
        return runs[world]
    return get


# ----------------------------------------------------------------------------- ranks

def assert_same_training(w1: dict, w2: dict, toy: str):
    """Weights of one process and of two ranks agree to 1e-5, and training moved them 100x further.
    Gloo's reductions and micro-batch padding reorder fp32 sums, so the gradients differ by their
    rounding (~1e-9 here, more on a CPU whose GEMM kernels round otherwise: AVX2's against AVX512's).
    Adam divides by sqrt(v) + eps: with eps 1e-8 a gradient entry that is rounding noise still
    takes a step of ~lr, in either sign, and the weights differed by 1.3e-5 on AVX2. TRAIN's
    adam_epsilon 1e-5 bounds what a gradient difference d changes a step by (lr x d / eps:
    ~1e-7), and entries with real gradients (>> eps) still step by ~lr."""
    w0 = load_file(Path(toy) / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w0 if k in w1)
    assert moved > 1e-3, moved


def test_two_ranks_match_one_process(straight, toy):
    (one, _), (two, log) = straight(1), straight(2)
    assert "fsdp checks passed (3 modules, tied=True)" in log
    assert_same_training(weights(one), weights(two), toy)
    for phase in ("before", "after"):  # each rank sampled its share of the eval (n=2, T=1): the same records
        assert (one / f"eval_{phase}.jsonl").read_text() == (two / f"eval_{phase}.jsonl").read_text()
    m1, m2 = metrics(one), metrics(two)
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [0, 1, 2, 3, 4, 4]
    for r1, r2 in zip(m1, m2):  # global means, not rank 0's share
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r2[k] == pytest.approx(r1[k], rel=1e-4, abs=1e-6), (r1["step"], k)


def test_two_ranks_with_uneven_updates_match_one_process(toy, tmp_path):
    """Without a KL term the update leaves out flat groups and masked truncated sequences, so
    the ranks hold different numbers of micro-batches (in this setup 0, 1 or 2 per rank and
    step); the short rank pads with masked ones, or FSDP's collectives would hang."""
    uneven = dict(model_path=toy, beta=0.0, loss_type="dr_grpo", scale_rewards="group",
                  mask_truncated_completions=True, micro_batch_tokens=24, eval_limit=0)
    at_once(lambda: launch(1, tmp_path / "one", **uneven), lambda: launch(2, tmp_path / "two", **uneven))
    assert_same_training(weights(tmp_path / "one"), weights(tmp_path / "two"), toy)
    m1, m2 = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    trained = [r["update/sequences"] for r in m1 if "update/sequences" in r]
    assert 0 < sum(trained) < 4 * 16, trained  # some sequences were left out, some trained
    assert [r.get("update/sequences") for r in m1] == [r.get("update/sequences") for r in m2]


def test_lora_two_ranks_match_one_process_and_resume_bitwise(toy, tmp_path):
    """LoRA under FSDP2: blocks whose base is frozen and whose adapters train (only theirs are
    reduced), the KL reference as the base with adapters off (TRAIN's beta > 0). Two ranks against one
    process without dropout (its masks depend on how rows fall on ranks); then with dropout, 2 steps,
    SIGTERM, resume from a checkpoint that holds the adapters only, 2 steps: bitwise the straight run."""
    lora = dict(model_path=toy, use_peft=True, lora_r=4, lora_alpha=16)  # TRAIN's lr: the tolerance holds (s = 4)
    # independent runs two at a time (tests/parallel.py): one process and two ranks; the straight
    # run and the one stopped at step 2
    at_once(lambda: launch(1, tmp_path / "one", **lora, lora_dropout=0.0),
            lambda: launch(2, tmp_path / "two", **lora, lora_dropout=0.0))
    assert_same_training(weights(tmp_path / "one"), weights(tmp_path / "two"), toy)
    _, log = at_once(lambda: launch(1, tmp_path / "straight", **lora),
                     lambda: launch(1, tmp_path / "resumed", **lora, sigterm_at_step=2))
    assert "SIGTERM: checkpoint written at step 2" in log
    launch(1, tmp_path / "resumed", **lora, resume=True)
    assert_bitwise(tmp_path / "straight", tmp_path / "resumed")
    with pytest.raises(AssertionError, match="lora_r: 4 there, 8 now"):  # a resume keeps the adapters' shape
        launch(1, tmp_path / "resumed", **(lora | {"lora_r": 8}), resume=True)


def test_exports_from_two_ranks_load_in_transformers(straight, tied):
    import transformers
    (two, _) = straight(2)
    # the trained export (untied), and the tied model as loaded
    for folder, source in ((two / "export", None), (two / "check_export", tied)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(folder)
        saved = load_file(folder / "model.safetensors")
        for k, v in hf.state_dict().items():
            expected = saved.get(k, saved.get("model.embed_tokens.weight"))
            torch.testing.assert_close(v, expected, atol=0, rtol=0, msg=k)
        if source:  # the gathered tied weights are the checkpoint's, and still tied
            assert hf.config.tie_word_embeddings and "lm_head.weight" not in saved
            source_weights = load_file(Path(source) / "model.safetensors")
            assert all(torch.equal(v, source_weights[k]) for k, v in saved.items())


# ----------------------------------------------------------------------------- resume

@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_then_resume_is_bitwise(world, straight, toy, tmp_path):
    """With 2 ranks, rank 1 does not see the checkpoint (a network filesystem's stale view): it
    resumes what rank 0 chose, not step 0 (which ended with ranks at different steps)."""
    log = launch(world, tmp_path, model_path=toy, sigterm_at_step=2)
    assert "SIGTERM: checkpoint written at step 2, exiting" in log
    assert (tmp_path / "checkpoints" / "step_000002" / "meta.json").exists()
    assert not (tmp_path / "export").exists()  # a stopped job leaves a checkpoint, not an export
    log = launch(world, tmp_path, model_path=toy, resume=True,
                 **({"hide_newest_checkpoint_on_rank": 1} if world == 2 else {}))
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_000002'} at step 2" in log
    assert_bitwise(straight(world)[0], tmp_path)


def test_sigkill_during_save_leaves_the_previous_checkpoint(straight, toy, tmp_path):
    """Two ranks save every step; the save of step 3 hangs after every shard is written, before
    the commit (the HANG_ENV hook), and torchrun and both ranks get SIGKILL."""
    ckpts = tmp_path / "checkpoints"
    p = subprocess.Popen(command(2, tmp_path, model_path=toy, save_steps=1), env=environ(**{HANG_ENV: "3"}),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        written = (".metadata", "rng_0.pt", "rng_1.pt")
        while not all((ckpts / "step_000003.tmp" / f).exists() for f in written):
            assert p.poll() is None and time.time() < deadline, \
                "the run ended or stalled before the save of step 3"
            time.sleep(0.2)
        time.sleep(0.5)  # now in the hook's sleep
    finally:  # torchrun starts each rank in a session of its own: kill the ranks, then torchrun
        pids = children(p.pid)
        for pid in pids + [p.pid]:
            os.kill(pid, signal.SIGKILL)
        p.wait()
        deadline = time.time() + 30
        while any(map(alive, pids)):
            assert time.time() < deadline, f"ranks {pids} survived SIGKILL"
            time.sleep(0.1)
    assert sorted(x.name for x in ckpts.iterdir()) == ["step_000001", "step_000002", "step_000003.tmp"]
    log = launch(2, tmp_path, model_path=toy, save_steps=1, resume=True)
    assert f"skipping {ckpts / 'step_000003.tmp'} (an interrupted save" in log
    assert f"resumed from {ckpts / 'step_000002'} at step 2" in log
    assert sorted(x.name for x in ckpts.iterdir()) == ["step_000003", "step_000004"]  # keep_last=2
    assert_bitwise(straight(2)[0], tmp_path)  # saving every step changes nothing either


def test_partial_and_corrupt_checkpoints_are_skipped(toy, tmp_path, capsys):
    model = Transformer.from_pretrained(toy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = Checkpointer(str(tmp_path), keep_last=3)
    saved = {}
    try:
        for step in (1, 2, 3):
            model(torch.tensor([[3, 4, 5]])).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            ckpt.save(step, model, optimizer, scheduler, meta={"data": {}})
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        root = tmp_path / "checkpoints"
        (root / "step_000003" / "meta.json").unlink()  # partial: a folder copied by hand, say
        distcp = next((root / "step_000002").glob("*.distcp"))
        distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])  # corrupt: truncated shard
        (root / "step_000004.tmp").mkdir()  # an interrupted save
        (root / "step_000004.tmp" / "__0_0.distcp").write_bytes(b"half")
        found = ckpt.load_latest(model, optimizer, scheduler)
        out = capsys.readouterr().out
        assert found["step"] == 1 and scheduler.last_epoch == 1
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[1][k]), k
        assert f"skipping {root / 'step_000004.tmp'} (an interrupted save" in out
        assert f"skipping {root / 'step_000003'} (incomplete: no meta.json)" in out
        assert f"skipping {root / 'step_000002'} (unreadable: " in out
        (root / "step_000001" / ".metadata").unlink()
        # never train on half-loaded weights
        with pytest.raises(RuntimeError, match="no loadable checkpoint"):
            ckpt.load_latest(model, optimizer, scheduler)
    finally:
        ckpt.close()


# ----------------------------------------------------------------------------- ranks agree

REWARD_ERROR = "ValueError: reward function failed on purpose (rank 1)"


def test_one_rank_failing_ends_every_rank_with_its_message(toy, tmp_path):
    """Rank 1's reward function raises in step 2; rank 0's next collective fails when rank 1
    leaves, and it says why: rank 1's error, not gloo's closed connection."""
    r = subprocess.run(command(2, tmp_path, model_path=toy, raise_at_step=2), env=environ(),
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"[rank1]: {REWARD_ERROR}" in out
    assert f"[rank0]: RuntimeError: stopping, rank 1: {REWARD_ERROR}" in out, out[-3000:]


def test_a_stalled_rank_ends_with_the_failing_ranks_message(toy, tmp_path):
    """No torchrun to end the job (as for the ranks on another node): rank 1 raises in step 2
    while rank 0 is stalled in its own reward function, where no collective error reaches it.
    Rank 0 must end within seconds with rank 1's message, not after the process group's timeout."""
    args = [f"--{k}={v}" for k, v in {**TRAIN, "output_dir": tmp_path, "model_path": toy, "raise_at_step": 2,
                                       "stall_at_step": 2}.items()]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=environ(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1]
    assert REWARD_ERROR in outs[1][1]
    assert f"[rank0]: stopping, rank 1: {REWARD_ERROR}" in outs[0][1], outs[0][1][-3000:]


def test_the_time_budget_is_one_clock(toy, tmp_path):
    """Rank 1's clock runs 10,000 times fast: by its clock the 10-minute budget is spent in step 1,
    by rank 0's never. The ranks stop together (the slower clock would leave rank 0 in step 2's
    collectives alone), after step 1, and both exit 0."""
    log = launch(2, tmp_path, timeout=120, model_path=toy, time_budget_min=10, fast_clock_rank=1,
                 eval_limit=0)
    assert "time budget (10.0 min for RL): stopping after 1 steps" in log
    assert [r["step"] for r in metrics(tmp_path) if "reward/mean" in r] == [1]


def test_warm_start_splits_its_batch_over_ranks(toy, tmp_path):
    """Each rank renders and trains on half of every warm-start batch (it ran all of it on every
    rank: twice the compute for the same gradient), and the weights are one process's."""
    sft = dict(model_path=toy, sft_steps=2, sft_batch=4, max_steps=0, eval_limit=0)
    one, two = at_once(lambda: launch(1, tmp_path / "one", **sft), lambda: launch(2, tmp_path / "two", **sft))
    assert "rank 0: 8 gold trajectories" in one
    assert "rank 0: 4 gold trajectories" in two and "rank 1: 4 gold trajectories" in two
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in w1:  # gloo's reductions reorder fp32 sums
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=k)
    m1, m2 = [[r for r in metrics(tmp_path / run) if "sft/loss" in r] for run in ("one", "two")]
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [0, 1]
    for r1, r2 in zip(m1, m2):  # the loss over the whole batch, not rank 0's half
        assert r2["sft/loss"] == pytest.approx(r1["sft/loss"], rel=1e-5)


def test_a_used_folder_is_refused_on_every_rank(straight, toy):
    """Rank 0 checks the folder and every rank raises its verdict (the others would otherwise go on
    to load the model and wait in its first collective)."""
    two, _ = straight(2)
    before = sorted(p.name for p in two.iterdir())
    r = subprocess.run(command(2, two, model_path=toy), env=environ(), capture_output=True, text=True,
                       timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    refusal = f"{two} holds another run (metrics.jsonl): use --resume to continue it, or another --output_dir"
    for rank in (0, 1):
        assert f"[rank{rank}]: FileExistsError: {refusal}" in out, out[-3000:]
    assert sorted(p.name for p in two.iterdir()) == before


ROPE_DTYPES = r'''
import torch, torch.distributed as tdist
import grpo.models.model as gm
import grpo.models.layers as layers
from grpo.infra import dist
from toy import make_toy_dir
import sys, pathlib
tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
seen, rope = [], layers.apply_rope
layers.apply_rope = lambda x, cos, sin: seen.append((x.dtype, cos.dtype, torch.is_grad_enabled())) or rope(x, cos, sin)
grads = []
for ckpt in (False, True):
    model = dist.shard(gm.Transformer.from_pretrained(make_toy_dir(pathlib.Path(sys.argv[1]) / str(ckpt))),
                       torch.bfloat16)
    model.activation_checkpointing = ckpt
    ids = torch.arange(24).reshape(2, 12) % 60 + 6
    model(ids, labels=ids).sum().backward()
    grads.append(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
print(sorted({(str(a), str(b)) for a, b, _ in seen}), len(seen))
print(((grads[0] - grads[1]).norm() / grads[0].norm()).item())
'''


def test_blocks_get_fp32_rope_tables_under_fsdp_mixed_precision(tmp_path):
    """FSDP2 casts a module's floating inputs to param_dtype in its pre-forward hook, but skips that
    hook in the backward's recompute under activation checkpointing (torch 2.11): the recomputed block
    then saw fp32 rope tables where the forward had seen bf16, and checkpoint raised (found on an H200).
    The blocks take their inputs uncast: q/k in bf16, tables fp32, in the forward and in the recompute,
    and the gradients equal those without checkpointing."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", ROPE_DTYPES, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    dtypes, err = r.stdout.strip().splitlines()[-2:]
    assert dtypes == "[('torch.bfloat16', 'torch.float32')] 12", dtypes  # 2 layers x (2 + 2 fwd + 2 recompute)
    assert float(err) < 1e-6, err

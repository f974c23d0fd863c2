"""Data parallelism: single-process fallbacks, and real multi-rank runs under torchrun.

The multi-rank tests launch this very file with ``python -m torch.distributed.run``; run as a script it
is the worker: each rank trains a tiny Qwen2 with the GRPO loss on its shard of a global batch, checks
after every step that all ranks hold identical parameters, and rank 0 checks them against a copy of
the model trained by one process on the full batch. Then checkpoints of a DDP and of an FSDP-sharded
model are saved and loaded into fresh models on every rank, which must continue bit for bit. Launched
with strategy "recipe", the worker runs the RL recipe itself (``train``) with ``run.strategy`` left at
its default, one rank keeping a group per step and the other none, and checks that policy and value
head stay identical on every rank. With strategy "sampling" it runs ``train`` on an env whose prompt
ignores the task seed: the ranks must start from identical weights yet sample different completions,
and the same ones again on a rerun. ``accelerate launch --multi_gpu`` starts the same worker as torchrun does.
Mixed precision (accelerate's autocast) is checked in process, on a layer and through the RL recipe.
"""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from envhub import Env, Observation, StepResult
from trainer.config import load_config
from trainer.distributed import (
    DistInfo,
    all_reduce_mean,
    barrier,
    broadcast_object,
    cleanup,
    exit_rank,
    init_distributed,
    max_over_ranks,
    shard,
    world_size,
    wrap_model,
)

GLOBAL_BATCH, GROUP, PROMPT, COMPLETION, STEPS, LR = 8, 4, 6, 6, 3, 1.0


# ---------------------------------------------------------------- single process


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_single_process_fallback(no_torchrun_env):
    info = init_distributed("gloo")
    assert info == DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    model = torch.nn.Linear(2, 2)
    assert wrap_model(model, "ddp", info) is model  # nothing to synchronise with
    t = torch.tensor([1.0, 3.0])
    assert all_reduce_mean(t) is t and t.tolist() == [1.0, 3.0]
    assert broadcast_object({"seed": 3}) == {"seed": 3}
    assert world_size() == 1 and max_over_ranks(3) == 3
    barrier()
    cleanup()


def test_shard_gives_each_rank_a_contiguous_slice():
    items = list(range(8))
    assert shard(items, DistInfo(rank=1, world_size=2, is_main=False)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible by world_size=3"):
        shard(items, DistInfo(rank=0, world_size=3))


def test_each_rank_samples_with_its_own_seed_and_a_single_process_with_run_seed():
    from trainer.distributed import rank, rank_seed, seed_rngs

    assert rank() == 0 and rank_seed(5, 0) == 5  # a single process (and rank 0) samples with run.seed itself
    seeds = {rank_seed(seed, r) for seed in range(4) for r in range(8)}
    assert len(seeds) == 32  # no two (run.seed, rank) pairs nearby share a stream
    draws = []
    for seed in (rank_seed(5, 0), rank_seed(5, 1), rank_seed(5, 0)):
        seed_rngs(seed)
        draws.append((torch.rand(3).tolist(), random.random()))
    assert draws[0] == draws[2] and draws[0] != draws[1]


def test_bad_strategy_and_fsdp_without_cuda_are_explained(no_torchrun_env):
    info = init_distributed("gloo")
    with pytest.raises(ValueError, match="Expected strategy in"):
        wrap_model(torch.nn.Linear(2, 2), "zero3", info)
    with pytest.raises(ValueError, match="Expected run.strategy in"):
        load_config(None, ["run.strategy='zero3'"])
    with pytest.raises(RuntimeError, match="strategy='ddp' on CPU"):
        wrap_model(torch.nn.Linear(2, 2), "fsdp", info)
    with pytest.raises(ValueError, match="Expected backend in"):
        init_distributed("mpi")


# ---------------------------------------------------------------- torchrun launches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_strategy_is_auto_and_none_refuses_several_ranks(no_torchrun_env):
    assert load_config(None, []).run.strategy == "auto"
    model = torch.nn.Linear(2, 2)
    one = init_distributed("gloo")
    assert wrap_model(model, "auto", one) is model and wrap_model(model, "none", one) is model
    # "none" with 2 ranks would let each rank train alone on its slice: refused before any collective
    with pytest.raises(ValueError, match="drift apart"):
        wrap_model(model, "none", DistInfo(rank=0, world_size=2))


def _launch(tmp_path: Path, nproc: int, backend: str, strategy: str, timeout: float = 300,
            launcher: str = "torchrun") -> list[dict]:
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                  "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    else:  # accelerate's multi-process launcher (torch.distributed.run underneath; --multi_gpu runs on CPU too)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port())]
    cmd = [*launch, __file__, str(tmp_path), backend, strategy]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


_EXIT_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from trainer.distributed import exit_rank
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined"))).start()
print("buffered, no newline", end="")
exit_rank(3)
"""


def test_exit_rank_does_what_a_normal_exit_does_then_leaves_with_the_status(tmp_path):
    """A rank ends through os._exit (no interpreter finalization, where gloo's threads can abort it), but
    nothing a normal exit would do is skipped: non-daemon threads finish, atexit handlers run, output is flushed."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"


def test_the_cli_ends_a_rank_through_exit_rank_with_the_runs_status(monkeypatch, capsys):
    from trainer import cli
    from trainer import distributed as dist_mod

    ended: list[int] = []

    class Ended(Exception):
        pass

    def fake_exit(code):
        ended.append(code)
        raise Ended

    monkeypatch.setattr(dist_mod, "exit_rank", fake_exit)
    assert cli.main(["--print-config"]) == 0 and ended == []  # no process group joined: a plain return
    monkeypatch.setattr(dist_mod, "_joined", True)
    with pytest.raises(Ended):
        cli.main(["--print-config"])
    boom = cli.Command("boom", "raises", lambda p: None, lambda args: 1 // 0)
    monkeypatch.setitem(cli.COMMANDS, "boom", boom)
    with pytest.raises(Ended):
        cli.main(["boom"])
    assert ended == [0, 1] and "ZeroDivisionError" in capsys.readouterr().err  # the traceback, then status 1


@pytest.mark.slow
def test_envhub_train_under_torchrun_exits_0_on_every_rank(tmp_path):
    """``torchrun -m trainer.cli`` as docs/training.md shows it (an in-process env here): every rank ends with 0."""
    root = Path(__file__).parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "trainer.cli",
           f"env.env_class='{Path(__file__).stem}:SeededAsciiEnv'", "env.train_task={}", "env.eval_task={}",
           "env.eval_key='seed'", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
           "model.num_kv_heads=1", "model.intermediate_size=64", "rollout.max_tokens_per_turn=6",
           "run.batch_size=2", "run.group_size=2", "run.eval_problems=1", "run.steps=2", "run.seed=1",
           f"run.output_dir='{tmp_path / 'run'}'"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count('"val_reward_after"') == 2  # each rank printed its summary
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_two_gloo_ranks_stay_in_step_and_match_one_rank_on_the_full_batch(tmp_path):
    results = _launch(tmp_path, 2, "gloo", "ddp")
    for result in results:
        assert result["world_size"] == 2 and result["device"] == "cpu"
        assert result["rank_spread"] == [0.0] * STEPS  # bit-identical parameters on every rank, every step
    assert results[0]["samples"] == [0, 1, 2, 3] and results[1]["samples"] == [4, 5, 6, 7]
    # DDP averages gradients; with equal token counts per rank that is the full-batch token mean
    assert all(diff < 1e-5 for diff in results[0]["vs_single_rank"]), results[0]["vs_single_rank"]
    assert results[0]["moved"] > 1e-3  # the parameters really moved, far beyond the tolerance above
    _assert_resumed_exactly(results)


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_ranks_in_step(tmp_path):
    # the wrapping is the same under both launchers, so the torchrun test above covers resume
    results = _launch(tmp_path, 2, "gloo", "ddp-only", launcher="accelerate")
    for result in results:
        assert result["world_size"] == 2 and result["wrapper"] == "DistributedDataParallel"
        assert result["rank_spread"] == [0.0] * STEPS
    assert all(diff < 1e-5 for diff in results[0]["vs_single_rank"]), results[0]["vs_single_rank"]
    assert results[0]["moved"] > 1e-3


@pytest.fixture
def fresh_accelerate_state():
    # accelerate keeps one state per process (mixed precision included): start and leave it blank
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_mixed_precision_autocasts_forward_and_keeps_fp32_parameters(no_torchrun_env, fresh_accelerate_state,
                                                                     monkeypatch):
    torch.manual_seed(0)
    model, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    fp32_out = model(x)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision bf16` sets
    wrapped = wrap_model(model, "auto", init_distributed("gloo"), mixed_precision="auto")
    out = wrapped(x)
    bf16_out = torch.nn.functional.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
    assert out.dtype == torch.float32 and torch.equal(out, bf16_out.float())  # computed in bf16, returned in fp32
    assert not torch.equal(out, fp32_out)
    out.sum().backward()
    assert model.weight.dtype == model.weight.grad.dtype == torch.float32


def test_the_rl_recipe_trains_under_bf16_autocast(tmp_path, no_torchrun_env, fresh_accelerate_state):
    from trainer.model import load_policy
    from trainer.recipes.rl import train

    cfg = load_config(None, [
        f"env.env_class='{__name__}:ConstantPromptEnv'", "env.train_task={}", "env.eval_task={}",
        "env.eval_key='seed'", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=64", "rollout.max_tokens_per_turn=6",
        "rollout.max_total_tokens=6", "algo.name='ppo'", "algo.kl_coef=0.05", "algo.filter_zero_variance=false",
        "run.batch_size=2", "run.group_size=2", "run.eval_problems=1", "run.steps=2", "optim.lr=1e-2",
        "run.mixed_precision='bf16'", f"run.output_dir='{tmp_path}'"])
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    summary = train(cfg, model=model, tokenizer=tok, log=lambda line: None)
    assert summary["steps"] == 2 and all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_mixed_precision_is_explained(no_torchrun_env, monkeypatch):
    with pytest.raises(ValueError, match="Expected mixed_precision in"):
        wrap_model(torch.nn.Linear(2, 2), "auto", init_distributed("gloo"), mixed_precision="fp8")
    with pytest.raises(ValueError, match="Expected run.mixed_precision in"):
        load_config(None, ["run.mixed_precision='half'"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="accelerate launch --mixed_precision no"):
        wrap_model(torch.nn.Linear(2, 2), "auto", init_distributed("gloo"), mixed_precision="auto")


@pytest.mark.slow
def test_the_rl_recipe_with_the_default_strategy_keeps_two_gloo_ranks_in_step(tmp_path):
    results = _launch(tmp_path, 2, "gloo", "recipe", timeout=120)  # uneven work used to hang here
    for result in results:
        assert result["world_size"] == 2 and result["strategy"] == "auto"
        assert result["policy_spread"] == [0.0] * RECIPE_STEPS  # bit-identical policies on every rank, every step
        assert result["value_head_spread"] == [0.0] * RECIPE_STEPS  # and value heads
    # uneven work: rank 1's groups all have equal rewards and are filtered out, rank 0 trains on its own
    assert results[0]["groups_kept"] == [1.0] * RECIPE_STEPS and results[1]["groups_kept"] == [0.0] * RECIPE_STEPS
    assert results[0]["samples_differ"]  # the ranks ran different episodes...
    assert results[0]["moved"] > 1e-3 and results[0]["head_moved"] > 0  # ...and really trained


@pytest.mark.slow
def test_asynchronous_rollouts_under_torchrun_keep_two_gloo_ranks_in_step(tmp_path):
    """Each rank samples ahead in its own rollout thread; the collectives stay in the training thread."""
    results = _launch(tmp_path, 2, "gloo", "recipe_async", timeout=180)
    for result in results:
        assert result["policy_spread"] == [0.0] * RECIPE_STEPS and result["value_head_spread"] == [0.0] * RECIPE_STEPS
        assert result["staleness"][0] == 0.0 and result["staleness"][1] == 1.0  # batch 1 sampled during step 0
    assert results[0]["moved"] > 1e-3


@pytest.mark.slow
def test_two_gloo_ranks_sample_differently_from_one_prompt_with_identical_initial_weights(tmp_path):
    results = _launch(tmp_path, 2, "gloo", "sampling", timeout=180)
    for result in results:
        assert result["world_size"] == 2
        assert result["init_spread"] == [0.0, 0.0]  # train() built the same LoRA-wrapped policy on every rank
        assert result["completions"] and result["completions"] == result["again"]  # a rerun samples the same
    # every rank saw the same prompt, yet sampled its own completions
    assert not set(results[0]["completions"]) & set(results[1]["completions"])


def _assert_resumed_exactly(results: list[dict]) -> None:
    rng_files = [f"rng_rank{r}.pt" for r in range(len(results))]
    for result in results:
        for strategy in ("ddp", "fsdp"):
            resumed = result["resume"][strategy]
            assert resumed == {"equal": True, "rng_restored": True, "step": 2, "rng_files": rng_files}, strategy


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_nccl_ranks_stay_in_step(tmp_path, strategy):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = min(2, torch.cuda.device_count())  # NCCL needs one GPU per rank
    results = _launch(tmp_path, nproc, "nccl", strategy)
    for result in results:
        assert result["device"].startswith("cuda")
        assert all(spread == 0.0 for spread in result["rank_spread"])
    assert all(diff < 1e-4 for diff in results[0]["vs_single_rank"]), results[0]["vs_single_rank"]
    _assert_resumed_exactly(results)


# ---------------------------------------------------------------- the worker


def _tiny_model(device, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(config).to(device)


def _grpo_loss(model, tokens_BT, advantages_B):
    from trainer.core.losses import token_logprobs, weighted_loss

    logits_BTV = model(input_ids=tokens_BT).logits
    logprobs_BT = token_logprobs(logits_BTV[:, PROMPT - 1:-1], tokens_BT[:, PROMPT:])
    # equal completion lengths: equal token counts per rank; weights 1/tokens make the core's sum a token mean
    inputs = {"advantages": advantages_B[:, None].expand_as(logprobs_BT),
              "weights": torch.full_like(logprobs_BT, 1.0 / logprobs_BT.numel())}
    loss, _, _ = weighted_loss("ppo", logprobs_BT, inputs, {})
    return loss


def _global_batch(gen):
    from trainer.algos import grpo_advantages

    tokens_BT = torch.randint(0, 64, (GLOBAL_BATCH, PROMPT + COMPLETION), generator=gen)
    rewards_BG = torch.randint(0, 2, (GLOBAL_BATCH // GROUP, GROUP), generator=gen).float()
    return tokens_BT, grpo_advantages(rewards_BG).reshape(-1)


def _step(model, optimizer, tokens_BT, advantages_B, device) -> None:
    loss = _grpo_loss(model, tokens_BT.to(device), advantages_B.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _flat(model) -> torch.Tensor:
    # FSDP parameters are DTensors: full_tensor() gathers them (a collective: every rank calls it)
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).float()
                      for p in model.parameters()])


def _train_in_step(info, strategy: str) -> dict:
    """Train on shards; record per step the spread across ranks and (rank 0) the gap to one full-batch rank."""
    import torch.distributed as dist

    model = _tiny_model(info.device)
    single = copy.deepcopy(model) if info.is_main else None
    start = _flat(model).cpu()
    wrapped = wrap_model(model, strategy, info)
    # plain SGD: its update is proportional to the gradient, so a wrong gradient scale (sum instead of
    # mean over ranks) shows up, where Adam would normalise it away
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    single_opt = torch.optim.SGD(single.parameters(), lr=LR) if single is not None else None
    gen = torch.Generator().manual_seed(1)
    report = {"rank_spread": [], "vs_single_rank": [], "samples": shard(list(range(GLOBAL_BATCH)), info),
              "wrapper": type(wrapped).__name__}
    for _ in range(STEPS):
        tokens_BT, advantages_B = _global_batch(gen)
        mine = report["samples"]
        _step(wrapped, optimizer, tokens_BT[mine], advantages_B[mine], info.device)
        flat = _flat(wrapped)
        gathered = [torch.zeros_like(flat) for _ in range(info.world_size)]
        dist.all_gather(gathered, flat)
        report["rank_spread"].append(max((g - flat).abs().max().item() for g in gathered))
        if single is not None:
            _step(single, single_opt, tokens_BT, advantages_B, info.device)
            report["vs_single_rank"].append((_flat(single) - flat).abs().max().item())
    report["moved"] = (flat.cpu() - start).abs().max().item()
    return report


def _fully_shard_any_device(model, info):
    """FSDP2 sharding; wrap_model allows it on CUDA only, but checkpoint gathering is the same on CPU/gloo."""
    if info.device.type == "cuda":
        return wrap_model(model, "fsdp", info)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _resume_round_trip(info, wrap, run_dir: Path) -> dict:
    """2 steps, save, 1 step -> A ; fresh model (other init, other RNG), load, the same step -> B ; A == B?"""
    from trainer.core import TrainingClient, load_checkpoint, resolve_checkpoint, save_checkpoint

    def client_of(model) -> TrainingClient:
        client = TrainingClient(model, None)
        for group in client.optimizer.param_groups:
            group["lr"] = 1e-2
        return client

    gen = torch.Generator().manual_seed(2)
    batches = [_global_batch(gen) for _ in range(3)]
    mine = shard(list(range(GLOBAL_BATCH)), info)
    client = client_of(wrap(_tiny_model(info.device)))
    for tokens_BT, advantages_B in batches[:2]:
        _step(client.model, client.optimizer, tokens_BT[mine], advantages_B[mine], info.device)
    torch.manual_seed(100 + info.rank)  # a different torch RNG stream on each rank
    save_checkpoint(client, run_dir, 2)
    rng_at_save = torch.get_rng_state()
    _step(client.model, client.optimizer, batches[2][0][mine], batches[2][1][mine], info.device)
    expected = _flat(client.model)
    fresh = client_of(wrap(_tiny_model(info.device, seed=5)))
    torch.manual_seed(999)
    meta = load_checkpoint(fresh, run_dir)
    rng_restored = torch.equal(torch.get_rng_state(), rng_at_save)
    _step(fresh.model, fresh.optimizer, batches[2][0][mine], batches[2][1][mine], info.device)
    return {"equal": torch.equal(_flat(fresh.model), expected), "rng_restored": rng_restored, "step": meta["step"],
            "rng_files": sorted(p.name for p in resolve_checkpoint(run_dir).glob("rng_rank*.pt"))}


RECIPE_STEPS = 2


class SeededAsciiEnv(Env):
    """Reward: the share of ASCII characters in the answer, or 0.5 for odd-numbered tasks (whose groups are then
    filtered out as zero-variance); the prompt depends on the task seed, so ranks differ.
    """

    seeds: list[int] = []  # every seed this process's episodes were reset with

    def reset(self, seed=None):
        SeededAsciiEnv.seeds.append(seed)
        self.constant = (seed - 1_000_003) % 2 == 1  # training seeds are 1_000_003 + task number (run.seed=1)
        return Observation(text=f"Write plain text about {seed}.")

    def on_text(self, text: str):
        if self.constant:
            return StepResult(reward=0.5, done=True)
        return StepResult(reward=sum(ch.isascii() for ch in text) / max(len(text), 1), done=True)


def _recipe_in_step(info, out_dir: str, *extra: str) -> dict:
    """``train`` (PPO, KL to a reference) with run.strategy left at its default; per step, the spread across ranks."""
    import torch.distributed as dist

    from trainer import algos
    from trainer.model import load_policy
    from trainer.recipes.rl import train

    heads = []

    class RecordedValueHead(algos.ValueHead):  # lets this worker see the value head train() builds
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            heads.append(self)

    algos.ValueHead = RecordedValueHead
    cfg = load_config(None, [
        f"env.env_class='{__name__}:SeededAsciiEnv'", "env.train_task={}", "env.eval_task={}", "env.eval_key='seed'",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "rollout.max_tokens_per_turn=6", "rollout.max_total_tokens=6",
        "algo.name='ppo'", "algo.kl_coef=0.05", "run.batch_size=2", "run.group_size=3", "run.eval_problems=1",
        "optim.lr=1e-2", "optim.micro_batch_size=1", "sampling.batch_wait_s=10.0",
        "run.seed=1", f"run.steps={RECIPE_STEPS}", f"run.output_dir='{Path(out_dir, 'run')}'", *extra])
    model, tok = load_policy(cfg.model)
    start = _flat(model)
    report = {"strategy": cfg.run.strategy, "policy_spread": [], "value_head_spread": [], "groups_kept": [],
              "staleness": []}

    def spread(flat: torch.Tensor) -> float:
        gathered = [torch.zeros_like(flat) for _ in range(info.world_size)]
        dist.all_gather(gathered, flat)
        return max((g - flat).abs().max().item() for g in gathered)

    def on_step(step, metrics):
        report["groups_kept"].append(metrics["rollout/groups_kept"])
        report["staleness"].append(metrics.get("rollout/staleness_max"))
        report["policy_spread"].append(spread(_flat(model)))
        report["value_head_spread"].append(spread(_flat(heads[0])))

    train(cfg, model=model, tokenizer=tok, on_step=on_step, log=lambda line: None)
    train_seeds = {s for s in SeededAsciiEnv.seeds if s >= 1_000_003}  # validation uses seeds 0, 1, ...
    per_rank = [None] * info.world_size
    dist.all_gather_object(per_rank, sorted(train_seeds))
    report["samples_differ"] = all(seeds for seeds in per_rank) and not set(per_rank[0]) & set(per_rank[1])
    report["moved"] = (_flat(model) - start).abs().max().item()
    report["head_moved"] = _flat(heads[0]).abs().max().item()
    return report


class ConstantPromptEnv(Env):
    """The same prompt whatever the task seed; records (seed, answer) of every episode of this process."""

    answers: list[tuple[int, str]] = []

    def reset(self, seed=None):
        self.seed = seed
        return Observation(text="Write plain text.")

    def on_text(self, text: str):
        ConstantPromptEnv.answers.append((self.seed, text))
        return StepResult(reward=sum(ch.isascii() for ch in text) / max(len(text), 1), done=True)


def _sampling(info, out_dir: str) -> dict:
    """``train`` twice with the same config (a LoRA policy built by train itself) on a seed-blind env:
    the training completions of each run, and the spread across ranks of the policy train() built,
    taken before DDP wraps it (so before DDP's broadcast from rank 0 could hide a difference).
    """
    import torch.distributed as dist

    import trainer.recipes.rl as rl

    spreads: list[float] = []
    wrap = rl.wrap_model

    def recording_wrap(model, strategy, info_, **kwargs):
        if hasattr(model, "generate"):  # the policy, not the value head
            flat = _flat(model)
            gathered = [torch.zeros_like(flat) for _ in range(info_.world_size)]
            dist.all_gather(gathered, flat)
            spreads.append(max((g - flat).abs().max().item() for g in gathered))
        return wrap(model, strategy, info_, **kwargs)

    rl.wrap_model = recording_wrap
    runs = []
    for n in range(2):
        cfg = load_config(None, [
            f"env.env_class='{__name__}:ConstantPromptEnv'", "env.train_task={}", "env.eval_task={}",
            "env.eval_key='seed'", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
            "model.num_kv_heads=1", "model.intermediate_size=64", "model.lora_rank=2",
            "rollout.max_tokens_per_turn=8", "rollout.max_total_tokens=8", "algo.filter_zero_variance=false",
            "run.batch_size=2", "run.group_size=2", "run.eval_problems=1", "optim.lr=1e-2",
            "sampling.batch_wait_s=10.0", "run.seed=1", "run.steps=1", f"run.output_dir='{Path(out_dir, f'run{n}')}'"])
        ConstantPromptEnv.answers = []
        rl.train(cfg, log=lambda line: None)
        runs.append(sorted(text for seed, text in ConstantPromptEnv.answers if seed >= 1_000_003))  # not validation
    return {"completions": runs[0], "again": runs[1], "init_spread": spreads}


def _worker(out_dir: str, backend: str, strategy: str) -> None:
    info = init_distributed(backend)
    if strategy in ("recipe", "recipe_async", "sampling"):
        run = {"recipe": _recipe_in_step, "sampling": _sampling,
               "recipe_async": lambda i, o: _recipe_in_step(i, o, "rollout.max_staleness=1")}[strategy]
        Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps({"world_size": info.world_size,
                                                                      **run(info, out_dir)}))
        barrier()
        exit_rank(0)
    report = {"world_size": info.world_size, "device": str(info.device),
              **_train_in_step(info, strategy.removesuffix("-only"))}
    report["resume"] = {} if strategy.endswith("-only") else {
        "ddp": _resume_round_trip(info, lambda m: wrap_model(m, "ddp", info), Path(out_dir, "ckpt_ddp")),
        "fsdp": _resume_round_trip(info, lambda m: _fully_shard_any_device(m, info), Path(out_dir, "ckpt_fsdp")),
    }
    Path(out_dir, f"rank{info.rank}.json").write_text(json.dumps(report))
    barrier()
    exit_rank(0)  # a plain exit can abort here: DDP keeps gloo's threads alive into interpreter finalization


if __name__ == "__main__":
    _worker(*sys.argv[1:4])

"""The RL update's typed edges: a rank that kept nothing still runs the passes, a frozen client has no
optimizer state to checkpoint, and the update takes the algorithm's own config, no recipe's."""

from __future__ import annotations

import pytest
import torch

from trainer.config import AlgoConfig, OptimConfig
from trainer.core import TrainingClient, load_checkpoint, save_checkpoint
from trainer.distributed import pad_to_ranks
from trainer.model import ModelConfig, load_policy
from trainer.update import adam_params, pack, padding_row, policy_update

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def test_a_rank_that_kept_no_group_trains_on_padding_rows_that_change_nothing() -> None:
    torch.manual_seed(0)
    model, tok = load_policy(TINY)
    # under torchrun another rank kept 3 rows; one process never pads
    pad = padding_row(tok.pad_token_id)
    assert pad_to_ranks([], pad) == [] and pad_to_ranks([pad], pad) == [pad]
    rows = [pad] * 3
    batch = pack([t for t, _ in rows], [a for _, a in rows], tok.pad_token_id)
    assert len(batch) == 3 and batch.tokens_BT.shape == (3, 2) and float(batch.mask_BS.sum()) == 0.0
    client = TrainingClient(model, tok)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = policy_update(client, batch, adam_params(OptimConfig(lr=1e-2), 0, 1), AlgoConfig(),
                            temperature=1.0, seed=0)
    assert "train/loss" not in metrics and metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="at least one trajectory"):
        pack([], [], tok.pad_token_id)
    with pytest.raises(ValueError, match="one advantage list for each, got 3 and 2"):
        pack([t for t, _ in rows], [pad[1]] * 2, tok.pad_token_id)


def test_a_forward_only_client_has_no_optimizer_to_checkpoint_and_a_trained_one_round_trips(tmp_path) -> None:
    torch.manual_seed(0)
    model, tok = load_policy(TINY)
    frozen = TrainingClient(model, tok, params=[])
    assert frozen.optimizer is None
    with pytest.raises(ValueError, match="forward-only"):
        save_checkpoint(frozen, tmp_path / "frozen", 1)
    client = TrainingClient(model, tok)
    save_checkpoint(client, tmp_path / "ckpt", 3, metadata={"policy_version": 3})
    saved = next(model.parameters()).detach().clone()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    meta = load_checkpoint(client, tmp_path / "ckpt")
    assert meta["step"] == 3 and meta["policy_version"] == 3 and torch.equal(next(model.parameters()), saved)
    with pytest.raises(ValueError, match="forward-only"):
        load_checkpoint(frozen, tmp_path / "ckpt")


def _four_step_batch(tok):  # 4 trajectories, 2 epochs x 2 minibatches = 4 optimizer steps without an early stop
    from trainer.rollout.types import Task, Trajectory

    torch.manual_seed(1)
    trajs, advs = [], []
    for k in range(4):
        tokens = torch.randint(3, 200, (12,)).tolist()
        mask = [0] * 4 + [1] * 8
        trajs.append(Trajectory(task=Task({}), tokens=tokens, mask=mask, logprobs=[0.0] * 12, turn_ends=[11],
                                turn_rewards=[1.0]))
        advs.append([0.0] * 4 + [(-1.0) ** k * 5.0] * 8)
    return pack(trajs, advs, tok.pad_token_id)


@pytest.mark.parametrize("target_kl, steps", [(0.0, 4), (1e9, 4), (1e-9, 1)])
def test_target_kl_stops_a_steps_update_at_the_first_minibatch_past_it(target_kl: float, steps: int) -> None:
    model, tok = load_policy(TINY)
    client = TrainingClient(model, tok)
    batch = _four_step_batch(tok)
    algo = AlgoConfig(name="grpo", epochs=2, minibatches=2, target_kl=target_kl)
    metrics = policy_update(client, batch, adam_params(OptimConfig(lr=5e-2), 0, 1), algo, temperature=1.0, seed=0)
    # the first minibatch always steps (pi_old is the policy before it); each later one is checked first
    assert client.version == steps
    assert metrics.get("train/update_steps", float(steps)) == float(steps)
    assert ("train/update_steps" in metrics) == bool(target_kl)
    if steps == 1:  # the stopping minibatch's forward is logged: the KL that stopped it
        assert metrics["train/approx_kl"] > 0.0
    # the largest fall of a sampled token's log-prob during the update (pi_old: the forward-only pass)
    assert metrics["train/max_logprob_drop"] > 0.0


def test_a_single_on_policy_pass_reports_no_logprob_drop() -> None:
    model, tok = load_policy(TINY)
    metrics = policy_update(TrainingClient(model, tok), _four_step_batch(tok), adam_params(OptimConfig(lr=5e-2), 0, 1),
                            AlgoConfig(name="grpo"), temperature=1.0, seed=0)
    assert "train/max_logprob_drop" not in metrics and "train/update_steps" not in metrics


def test_target_kl_is_refused_below_zero_or_not_finite() -> None:
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="algo.target_kl >= 0"):
            AlgoConfig(target_kl=bad)


def test_each_sequence_of_a_windowed_trajectory_packs_as_a_row_with_its_advantages_and_rewards() -> None:
    from trainer.rollout import Task, Trajectory

    whole = Trajectory(task=Task({}), tokens=[1, 2, 3, 4], mask=[0, 0, 1, 1], logprobs=[0, 0, -0.1, -0.2],
                       turn_ends=[3], turn_rewards=[1.0])
    windowed = Trajectory(task=Task({}))
    windowed.append([5, 6], policy=False)
    windowed.append([7], policy=True, logprobs=[-0.3])
    windowed.turn_ends.append(2)
    windowed.new_segment()
    windowed.append([5, 8, 9], policy=False)
    windowed.append([10, 11], policy=True, logprobs=[-0.4, -0.5])
    windowed.turn_ends.append(7)
    windowed.turn_rewards = [0.5, 2.0]
    adv = [[0.0, 0.0, 1.5, 1.5], [0, 0, -1.0, 0, 0, 0, 2.0, 2.0]]
    batch = pack([whole, windowed], adv, pad_id=0)
    assert batch.tokens_BT.tolist() == [[1, 2, 3, 4, 0], [5, 6, 7, 0, 0], [5, 8, 9, 10, 11]]
    # the shifted frame: position j scores token j + 1
    assert batch.mask_BS.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert batch.advantages_BS.tolist() == [[0, 1.5, 1.5, 0], [0, -1.0, 0, 0], [0, 0, 2.0, 2.0]]
    assert batch.rewards_BS.tolist() == [[0, 0, 1.0, 0], [0, 0.5, 0, 0], [0, 0, 0, 2.0]]
    assert batch.sampler_logprobs_BS[2].tolist() == pytest.approx([0, 0, -0.4, -0.5])

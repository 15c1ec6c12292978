"""Advantages and policy losses against numbers worked out by hand."""

import math

import pytest
import torch

from tlt.config import ActorConfig, AlgorithmConfig
from tlt.rl.advantages import (advantages_to_tokens, compute_advantages, get_adv_estimator, groups_to_keep,
                               keep_mask, register_adv_estimator, scores_to_tensor)
from tlt.rl.losses import (agg_loss, clipped_surrogate, compute_actor_loss, entropy_from_logits, get_policy_loss,
                           kl_penalty)

# group a: [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025
# group b: all equal -> 0; group c: one response -> 0
# group d: [0, None, 1] -> None left out: mean 0.5, std sqrt(0.5) -> +-0.707107, None -> 0 and masked
GROUPS = ["a", "a", "a", "a", "b", "b", "c", "d", "d", "d"]
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, None, 1.0]


def test_grpo_hand_computed():
    adv = compute_advantages(SCORES, GROUPS, AlgorithmConfig())
    s, r = 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(0.5)
    expected = [s, -s, -s, s, 0, 0, 0, -r, 0, r]
    assert adv.values.tolist() == pytest.approx(expected, abs=1e-5)
    assert adv.valid_mask.tolist() == [True] * 8 + [False, True]


def test_grpo_without_std_norm_and_rloo():
    adv = compute_advantages(SCORES, GROUPS, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert adv.values.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, -0.5, 0, 0.5])
    rloo = compute_advantages(SCORES, GROUPS, AlgorithmConfig(adv_estimator="rloo"))
    # 1 - (1 + 0 + 0) / 3 = 2/3; 0 - (1 + 0 + 1) / 3 = -2/3; group d: 0 - 1 = -1, 1 - 0 = 1
    assert rloo.values.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, -1, 0, 1])


def test_nan_counts_as_missing_and_tokens_broadcast():
    adv = compute_advantages(torch.tensor([2.0, float("nan"), 4.0]), [0, 0, 0], AlgorithmConfig())
    assert adv.valid_mask.tolist() == [True, False, True]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tokens = advantages_to_tokens(adv, mask)
    a = 1 / math.sqrt(2)  # (2 - 3) / std([2, 4]) with std = sqrt(2)
    assert tokens.flatten().tolist() == pytest.approx([-a, -a, 0, 0, 0, 0, a, 0, 0], abs=1e-5)


def test_registry():
    @register_adv_estimator("test_zero")
    def zero(scores, group_ids, cfg):
        return get_adv_estimator("grpo")(scores * 0, group_ids, cfg)

    assert compute_advantages([1.0, 2.0], [0, 0], AlgorithmConfig(adv_estimator="test_zero")).values.tolist() == [0, 0]
    with pytest.raises(KeyError, match="registered: .*grpo"):
        get_adv_estimator("gae_typo")


def test_dynamic_sampling_keeps_groups_with_signal():
    kept = groups_to_keep(GROUPS, SCORES)
    assert kept == ["a", "d"]  # b all equal, c a single response
    assert groups_to_keep(["x", "x", "y", "y"], [None, 1.0, 0.0, 0.0]) == []
    assert keep_mask(GROUPS, kept).tolist() == [True] * 4 + [False] * 3 + [True] * 3
    assert scores_to_tensor([1, None]).isnan().tolist() == [False, True]


# ratios [[1.5, 0.5, 1.0], [1.5, 0.5, 2.0]], advantages [[1, 1, -1], [-1, -1, 1]], last token of row 1 masked.
# clip range [0.8, 1.28]. Per token max(-A r, -A clip(r)):
#   [1.5, A=1] -> max(-1.5, -1.28) = -1.28 (clipped, upper)   [0.5, A=1] -> max(-0.5, -0.8) = -0.5
#   [1.0, A=-1] -> 1                                          [1.5, A=-1] -> max(1.5, 1.28) = 1.5
#   [0.5, A=-1] -> max(0.5, 0.8) = 0.8 (clipped, lower)
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 2.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.full((2, 3), -1.0)
PG = [[-1.28, -0.5, 1.0], [1.5, 0.8]]


def test_clipped_surrogate_both_sides():
    pg, metrics = clipped_surrogate(OLD + RATIOS.log(), OLD, ADV, MASK, ActorConfig())
    assert pg[0].tolist() == pytest.approx(PG[0]) and pg[1, :2].tolist() == pytest.approx(PG[1])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-2 * math.log(0.75) / 5)  # mean of -log r
    one = torch.tensor([[1.25]]).log()
    assert clipped_surrogate(one, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                             ActorConfig())[0].item() == pytest.approx(-1.25)  # inside clip-higher 0.28
    assert clipped_surrogate(one, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                             ActorConfig(clip_ratio_high=0.2))[0].item() == pytest.approx(-1.2)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (-1.28 - 0.5 + 1 + 1.5 + 0.8) / 5),  # 0.304
    ("seq-mean-token-sum", (-0.78 + 2.3) / 2),  # 0.76
    ("seq-mean-token-mean", (-0.78 / 3 + 2.3 / 2) / 2),  # 0.445
])
def test_aggregation_modes(mode, expected):
    log_probs = (OLD + RATIOS.log()).requires_grad_()
    loss, metrics = compute_actor_loss(log_probs, OLD, ADV, MASK, ActorConfig(loss_agg_mode=mode))
    assert loss.item() == pytest.approx(expected)
    assert metrics["actor/pg_loss"] == pytest.approx(expected)
    loss.backward()
    assert log_probs.grad[0, 0] == 0 and log_probs.grad[1, 1] == 0  # clipped tokens carry no gradient
    assert log_probs.grad[1, 2] == 0 and log_probs.grad[0, 1] != 0  # masked token; unclipped token


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_sum_to_full_batch(mode):
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 2 empty: left out
    full = agg_loss(loss_mat, mask, mode)
    parts = [agg_loss(loss_mat[s], mask[s], mode, global_num_tokens=5, global_num_seqs=2)
             for s in (slice(0, 1), slice(1, 3))]
    assert sum(parts).item() == pytest.approx(full.item())
    expected = {"token-mean": 18 / 5, "seq-mean-token-sum": (3 + 15) / 2, "seq-mean-token-mean": (1.5 + 5) / 2}
    assert full.item() == pytest.approx(expected[mode])


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5), math.log(0.25)]), torch.tensor([math.log(0.25), math.log(0.5)])
    # k3 = exp(ref - logp) - (ref - logp) - 1: [0.5 + ln 2 - 1, 2 - ln 2 - 1]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([0.193147, 0.306853], abs=1e-6)
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx([0.193147, 0.306853], abs=1e-6)
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([math.log(2), -math.log(2)])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5 * math.log(2) ** 2] * 2)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), "k3").item() == 10.0  # clamped like verl


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, -math.inf, -math.inf], [100.0, 0.0, 0.0, 0.0]])
    # uniform over 4: ln 4; p = [0.75, 0.25]: 0.75 ln(4/3) + 0.25 ln 4 = 0.562335; near one-hot: ~0
    logits.requires_grad_()
    entropy = entropy_from_logits(logits)
    assert entropy.tolist() == pytest.approx([math.log(4), 0.562335, 0.0], abs=1e-5)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()  # masked logits give no NaN gradient


def test_total_loss_with_entropy_and_kl():
    cfg = ActorConfig(entropy_coeff=0.1, use_kl_loss=True, kl_loss_coef=0.01)
    log_probs = OLD + RATIOS.log()
    entropy = torch.full((2, 3), 0.5)
    ref = log_probs + math.log(2)  # k3 = 2 - ln 2 - 1 = 0.306853 on every token
    loss, metrics = compute_actor_loss(log_probs, OLD, ADV, MASK, cfg, ref_log_probs=ref, entropy=entropy)
    assert loss.item() == pytest.approx(0.304 - 0.1 * 0.5 + 0.01 * 0.306853, abs=1e-6)
    assert metrics["actor/entropy"] == pytest.approx(0.5)
    assert metrics["actor/kl_loss"] == pytest.approx(0.306853, abs=1e-6)
    assert set(metrics) >= {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy"}
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_actor_loss(log_probs, OLD, ADV, MASK, cfg, entropy=entropy)
    with pytest.raises(KeyError, match="vanilla"):
        get_policy_loss("vanila")


def _gspo_by_sequence(log_probs, old, adv_seq, mask, low, high):
    """GSPO as the paper writes it: one ratio a response, s_i = (pi / pi_old)^(1 / |y_i|), clipped, mean over i."""
    m = mask.float()
    s = (((log_probs - old) * m).sum(-1) / m.sum(-1)).exp()
    return torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - low, 1 + high)).mean()


def test_gspo_token_form_has_the_sequence_objectives_value_and_gradient():
    """policy_loss=gspo (token form, aggregated per response) equals the sequence-level GSPO objective in value and
    gradient, with a response clipped (its gradient 0) and unequal lengths; vanilla's per-token ratios give
    another gradient (negative control)."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv_seq = torch.tensor([0.7, -1.2, 0.4, 1.0])
    shift = torch.randn(B, T, generator=g) * 2e-4
    shift[3] = 0.05  # response 3: ratio e^0.05, far outside the GSPO clip with a positive advantage
    cfg = ActorConfig(policy_loss="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)  # loss_agg_mode token-mean
    ours = (old + shift).requires_grad_()
    loss, metrics = compute_actor_loss(ours, old, adv_seq[:, None] * mask, mask, cfg)
    loss.backward()
    ref = (old + shift).requires_grad_()
    want = _gspo_by_sequence(ref, old, adv_seq, mask, 3e-4, 4e-4)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(ours.grad * mask, ref.grad * mask, rtol=1e-5, atol=1e-9)
    assert torch.all(ours.grad[3] == 0) and torch.all(ours.grad[:3][mask[:3] > 0] != 0)
    assert metrics["actor/pg_clipfrac"] > 0
    vanilla = (old + shift).requires_grad_()
    compute_actor_loss(vanilla, old, adv_seq[:, None] * mask, mask,
                       ActorConfig(clip_ratio_low=3e-4, clip_ratio_high=4e-4))[0].backward()
    assert not torch.allclose(vanilla.grad * mask, ref.grad * mask, rtol=1e-3, atol=0)


def test_gspo_on_policy_and_split_into_micro_batches():
    """On policy every ratio is 1: loss = -mean of the responses' advantages, nothing clipped; micro-batches
    normalised by the mini-batch's response count sum to the full batch."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, -3.0], [-2.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None] * mask
    cfg = ActorConfig(policy_loss="gspo")
    full, metrics = compute_actor_loss(logp, logp, adv, mask, cfg)
    assert full.item() == pytest.approx(-(1.0 - 0.5 + 2.0) / 3)
    assert metrics["actor/pg_clipfrac"] == 0 and metrics["actor/ppo_kl"] == 0
    parts = [compute_actor_loss(logp[s], logp[s], adv[s], mask[s], cfg, global_num_tokens=6, global_num_seqs=3)[0]
             for s in (slice(0, 2), slice(2, 3))]
    assert sum(parts).item() == pytest.approx(full.item())

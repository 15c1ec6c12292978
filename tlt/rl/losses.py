"""Policy losses (registry), loss aggregation, KL-to-reference and entropy, with verl's metric names.

All per-token tensors are [B, T] over response positions; response_mask [B, T] is 1 on real response tokens.
A policy loss maps (log_probs, old_log_probs, advantages, response_mask, cfg) to a per-token loss matrix plus
metrics; `compute_actor_loss` aggregates it (actor.loss_agg_mode) and adds the entropy and KL terms:

    loss = agg(pg_losses) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl(logp, ref_logp))

(A policy loss listed in PG_AGG_MODE aggregates its own term its way: GSPO per response.) Losses: vanilla (PPO's
clipped surrogate per token, DAPO's clip-higher) and gspo (one clipped ratio per response).

Gradient accumulation over micro-batches: pass global_num_tokens (token-mean) or global_num_seqs (seq-mean-*)
counted over the whole mini-batch, so that summing micro-batch losses equals the full-batch loss.
"""

from typing import Callable

import torch

from tlt.config import ActorConfig
from tlt.registry import Registry

Metrics = dict[str, float]
PolicyLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ActorConfig],
                      tuple[torch.Tensor, Metrics]]
_REGISTRY: Registry[PolicyLoss] = Registry("policy loss", "actor.policy_loss", "register_policy_loss")
register_policy_loss = _REGISTRY.register
get_policy_loss = _REGISTRY.get


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1e-8)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, global_num_tokens: float | None = None,
             global_num_seqs: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar (verl's agg_loss).

    token-mean:          sum over all tokens / number of tokens (long responses weigh more; DAPO)
    seq-mean-token-sum:  per-sequence sum, mean over sequences (Dr.GRPO-style, no length normalisation)
    seq-mean-token-mean: per-sequence mean, mean over sequences (original GRPO)
    Sequences with no response tokens are left out of the sequence means.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        if global_num_tokens is not None:
            return (loss_mat * mask).sum() / max(float(global_num_tokens), 1e-8)
        return (loss_mat * mask).sum() / mask.sum().clamp_min(1e-8)
    seq_tokens = mask.sum(-1)  # [B]
    seq_sum = (loss_mat * mask).sum(-1)  # [B]
    if mode == "seq-mean-token-sum":
        seq_losses = seq_sum
    elif mode == "seq-mean-token-mean":
        seq_losses = seq_sum / seq_tokens.clamp_min(1e-8)
    else:
        raise ValueError(f"unknown loss_agg_mode '{mode}': token-mean, seq-mean-token-sum, seq-mean-token-mean")
    seq_valid = (seq_tokens > 0).to(loss_mat.dtype)
    if global_num_seqs is not None:
        return (seq_losses * seq_valid).sum() / max(float(global_num_seqs), 1e-8)
    return (seq_losses * seq_valid).sum() / seq_valid.sum().clamp_min(1e-8)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3)."""
    if kind == "k1":
        return log_probs - ref_log_probs
    if kind == "k2":
        return 0.5 * (log_probs - ref_log_probs).square()
    if kind in ("k3", "low_var_kl"):
        # k3 = r - log r - 1 with r = ref/policy: non-negative, unbiased, low variance. Clamped as in verl so
        # that one token with a huge ratio cannot blow up the loss.
        log_ratio = (ref_log_probs - log_probs).clamp(-20, 20)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator '{kind}': k1, k2, k3 (= low_var_kl)")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropy of softmax(logits), in fp32.

    log-probs are clamped to the fp32 minimum so that masked (-inf) logits give 0 * finite = 0, not NaN.
    """
    return entropy_from_log_probs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """[..., V] log-softmax output -> [...] entropy (when the caller already has the log-softmax)."""
    return -(log_probs.exp() * log_probs.clamp_min(torch.finfo(torch.float32).min)).sum(-1)


@register_policy_loss("vanilla")
def clipped_surrogate(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor, cfg: ActorConfig) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with separate lower/upper clip ratios (DAPO clip-higher); per-token loss [B, T]."""
    log_ratio = (log_probs - old_log_probs).clamp(-20, 20)  # clamp as verl: exp must not overflow
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)  # pessimistic bound
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),  # approx KL(old || new), k1
    }
    return pg_losses, metrics


@register_policy_loss("gspo")
def gspo(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
         response_mask: torch.Tensor, cfg: ActorConfig) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): one importance ratio per response, the
    geometric mean of its token ratios, s_i = exp(mean_t(log pi - log pi_old)), clipped per response.

    Written in the token form (GSPO-token): s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], which equals s_i in value and,
    with one advantage per response (GRPO, RLOO), gives GSPO's gradient once averaged per response (PG_AGG_MODE:
    seq-mean-token-mean, whatever actor.loss_agg_mode says). Its clip ranges are about 1000x narrower than PPO's
    token clip (the paper: clip_ratio_low 3e-4, clip_ratio_high 4e-4)."""
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs).clamp(-20, 20)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1)     # [B] log s_i
    log_s = (log_probs - log_probs.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10)
    ratio = log_s.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
    }
    return pg_losses, metrics


PG_AGG_MODE = {"gspo": "seq-mean-token-mean"}  # policy losses defined with their own aggregation


def compute_actor_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, cfg: ActorConfig, ref_log_probs: torch.Tensor | None = None,
                       entropy: torch.Tensor | None = None, global_num_tokens: float | None = None,
                       global_num_seqs: float | None = None) -> tuple[torch.Tensor, Metrics]:
    """Total actor loss and metrics (actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, actor/entropy, actor/kl_loss).

    entropy: [B, T] per-token entropy (see entropy_from_logits), needed for the metric and entropy_coeff.
    ref_log_probs: [B, T], needed when cfg.use_kl_loss. Metrics use this micro-batch's own normalisation.
    """
    def agg(x: torch.Tensor, global_norm: bool = True, mode: str = cfg.loss_agg_mode) -> torch.Tensor:
        if not global_norm:
            return agg_loss(x, response_mask, mode)
        return agg_loss(x, response_mask, mode, global_num_tokens, global_num_seqs)

    pg_losses, metrics = get_policy_loss(cfg.policy_loss)(log_probs, old_log_probs, advantages, response_mask, cfg)
    pg_mode = PG_AGG_MODE.get(cfg.policy_loss, cfg.loss_agg_mode)
    loss = agg(pg_losses, mode=pg_mode)
    metrics["actor/pg_loss"] = agg(pg_losses.detach(), global_norm=False, mode=pg_mode).item()
    if entropy is not None:
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * agg(entropy)
        metrics["actor/entropy"] = agg(entropy.detach(), global_norm=False).item()
    elif cfg.entropy_coeff:
        raise ValueError("actor.entropy_coeff > 0 needs the per-token entropy (pass entropy=...)")
    if cfg.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("actor.use_kl_loss needs reference log-probs (pass ref_log_probs=...)")
        kl = kl_penalty(log_probs, ref_log_probs, cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * agg(kl)
        metrics["actor/kl_loss"] = agg(kl.detach(), global_norm=False).item()
        metrics["actor/kl_coef"] = cfg.kl_loss_coef
    return loss, metrics

"""SpecConfig: the one speculative-decoding config, written as the `speculative` section of a run config
(`speculative.bs_threshold=16`) or passed to `tlt.LLM(speculative_config={...})`, with vLLM's key names where the
meaning matches. Both ways go through the same field types, bounds and cross-key checks (tlt.schema).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from tlt.schema import ConfigError, close_matches_hint, option, set_option
from tlt.speculative.policy import DRAFTER_METHODS, OFF, AdaptivePolicy, Arm


def _chain(d: int) -> Arm:
    return Arm(f"chain{d}", "eagle_chain", depth=d, topk=1, num_draft_tokens=d)


def _tree(d: int, k: int, n: int) -> Arm:
    return Arm(f"tree{d}x{k}n{n}", "eagle_tree", depth=d, topk=k, num_draft_tokens=n)


def _ngram(n: int) -> Arm:
    return Arm(f"ngram{n}", "ngram", depth=n, num_draft_tokens=n)


def default_arm_table(table: str = "cpu") -> tuple[list[float], list[list[Arm]]]:
    """(bucket upper bounds, arms per bucket), in trial order. "gpu": fastrl's trees (depth 8, topk 4; verify budget
    by bucket 48 / 32 / 16 / 8), the same tree cut to half that budget, a depth-4 chain, n-gram and off; the deep tree
    comes first, as its steps also say what the two arms nested in it would have emitted (policy.nested_in). "cpu",
    for a ~135M target on 2 cores, where a verify token costs a real share of a step: chains of depth 1 and 2 and
    n-gram below bs 21, plain decoding above (the arms that never paid there are left out:
    docs/results/spec_arms_cpu-zen4_2026-11-26.txt)."""
    bounds = [1, 4, 20, math.inf]
    if table == "gpu":
        return bounds, [[OFF, _tree(8, 4, n), _tree(8, 4, n // 2), _chain(4), _ngram(8)]
                        for n in (48, 32, 16, 8)]
    if table != "cpu":
        raise ValueError(f"arm table must be 'cpu' or 'gpu', got {table!r}")
    return bounds, [[OFF, _ngram(n), _chain(1), _chain(2)] for n in (6, 4, 3)] + [[OFF]]


@dataclass
class SpecConfig:
    enabled: bool = option(True, "speculative decoding in rollouts; false = plain decoding (tlt.LLM: as if "
                                 "speculative_config were None)")
    method: Literal["eagle", "ngram"] = option(
        "eagle", "eagle = learned one-layer drafter (plus n-gram arms when adaptive); ngram = model-free drafts only")
    model: str | None = option(None, "drafter directory (tlt.speculative.drafter_io layout); tlt.LLM needs one for "
                                     "eagle; in a run, null = the default model's warm-up drafter or a fresh one")
    num_speculative_tokens: int = option(4, "draft depth of the fixed arm (adaptive=false) and n-gram draft length",
                                         ge=1)
    bs_threshold: int | None = option(32, "SD only while the running batch <= this (the long tail); null = always on",
                                      ge=1)
    adaptive: bool = option(True, "the policy picks the arm (plain decoding, n-gram, EAGLE chain or tree) per "
                                  "batch-size bucket by its measured speed (docs/design.md §6); false = the one "
                                  "fixed arm below")
    draft_topk: int = option(1, "fixed arm: 1 = chain of num_speculative_tokens, > 1 = EAGLE-2 tree", ge=1)
    num_draft_tokens: int | None = option(None, "fixed tree arm: verify budget; null = depth * topk", ge=1)
    arm_table: Literal["auto", "cpu", "gpu"] = option(
        "auto", "the adaptive policy's arms: cpu (short chains; a verify token costs a real share of a step) or "
                "gpu (deep trees; verifying one costs about a decode step); auto = by the engine's device")
    acceptance: Literal["invariant", "rejection"] = option(
        "invariant", "invariant = deterministic drafts, the target's own draw accepted when a draft holds it (a "
                     "seeded request samples the same tokens with SD on or off); rejection = chain drafts sampled "
                     "from the drafter, Leviathan/Chen rejection sampling (the same law, other samples; accepts "
                     "more where the target is spread out, temperature ~1); docs/design.md §7")
    seed: int = option(0, "seed of a fresh drafter (a run sets trainer.seed)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpecConfig":
        """From `tlt.LLM(speculative_config=...)`: unknown keys, types, ranges and cross-key rules checked as for
        the run config's `speculative` section."""
        names = [f.name for f in dataclasses.fields(cls)]
        cfg = cls()
        for k, v in d.items():
            if k not in names:
                raise ConfigError(f"unknown speculative_config key {k!r}.{close_matches_hint(k, names)} "
                                  f"Valid keys: {', '.join(names)}")
            set_option(cfg, f"speculative_config.{k}", v, "speculative_config")
        cfg.validate(prefix="speculative_config.")
        return cfg

    def validate(self, prefix: str = "") -> None:
        """Checks that involve several keys."""
        if self.method == "ngram" and self.model is not None:
            raise ConfigError(f"{prefix}model is a drafter path, used only with {prefix}method=eagle")

    def engine_config(self, seed: int) -> dict[str, Any] | None:
        """`tlt.LLM(speculative_config=...)` for a run: every key, with the run's seed (None when disabled)."""
        if not self.enabled:
            return None
        return {**dataclasses.asdict(self), "seed": seed}

    def arms(self, has_drafter: bool, device_type: str) -> tuple[list[float], list[list[Arm]]]:
        """(bucket upper bounds, arms per bucket) for the policy; eagle arms only with a drafter."""
        if not self.adaptive:
            k = self.num_speculative_tokens
            if self.method == "ngram":
                arm = _ngram(k)
            elif self.draft_topk == 1:
                arm = _chain(k)
            else:
                arm = _tree(k, self.draft_topk, self.num_draft_tokens or k * self.draft_topk)
            return [math.inf], [[arm]]
        table = self.arm_table if self.arm_table != "auto" else ("gpu" if device_type == "cuda" else "cpu")
        bounds, arms = default_arm_table(table)
        keep = (lambda a: True) if has_drafter else (lambda a: a.method not in DRAFTER_METHODS)
        return bounds, [[a for a in bucket if keep(a)] or [OFF] for bucket in arms]

    def policy(self, has_drafter: bool, device_type: str) -> AdaptivePolicy:
        bounds, arms = self.arms(has_drafter, device_type)
        return AdaptivePolicy(bounds, arms, bs_threshold=self.bs_threshold)

    def max_draft_len(self) -> int:
        """Upper bound on positions one SD step writes past a sequence's end: the verified tree in the target's cache,
        the eager draft (depth x top-k) and a catch-up pass in the drafter's (for cache headroom)."""
        k = self.num_speculative_tokens
        return max(64, 2 * k, self.num_draft_tokens or 0, k * self.draft_topk)  # the eager draft writes depth x top-k

    def cache_headroom(self) -> int:
        """Positions past a sequence's worst-case length that its steps may write (a verified tree and the root; the
        drafter's padded catch-up): reserved in the KV caches at admission and in each row's hidden-state record."""
        return self.max_draft_len() + 1

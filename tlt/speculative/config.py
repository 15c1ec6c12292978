"""SpecConfig: `tlt.LLM(speculative_config={...})`, with vLLM's key names where the meaning matches."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields


@dataclass
class SpecConfig:
    method: str = "eagle"                  # "eagle" (learned drafter) | "ngram" (model-free only)
    model: str | None = None               # drafter directory (tlt.speculative.drafter_io layout); required for eagle
    num_speculative_tokens: int = 4        # chain depth of the default eagle arms / n-gram draft length
    bs_threshold: int | None = 32          # SD only while the running batch <= this; None = always on
    hysteresis_steps: int = 4              # ... for this many consecutive decode steps
    adaptive: bool = True                  # bandit over the arm table; False = one fixed arm (below)
    draft_topk: int = 1                    # fixed arm: 1 = chain of num_speculative_tokens, > 1 = EAGLE-2 tree
    num_draft_tokens: int | None = None    # fixed tree arm: verify budget (default: depth * topk)
    device_profile: str = "auto"           # arm table: "cpu" (small budgets) | "gpu" (fastrl's) | "auto"
    epsilon: float = 0.1                   # bandit exploration probability
    window: int = 300                      # bandit sliding window (median reward)
    # "invariant": deterministic drafts, the target's own draw accepted when a draft holds it (seeded requests
    # sample the same tokens with SD on or off); "rejection": chain drafts sampled from the drafter, Leviathan/Chen
    # rejection sampling (the same law, other samples; accepts more where the target is spread out, temperature ~1)
    acceptance: str = "invariant"
    ngram_max_n: int = 4
    ngram_min_n: int = 2
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "SpecConfig":
        names = [f.name for f in fields(cls)]
        for k in d:
            if k not in names:
                near = difflib.get_close_matches(k, names, n=3)
                raise ValueError(f"unknown speculative_config key {k!r}"
                                 + (f" (did you mean {', '.join(near)}?)" if near else "")
                                 + f"; valid keys: {', '.join(names)}")
        cfg = cls(**d)
        if cfg.method not in ("eagle", "ngram"):
            raise ValueError(f"speculative_config method={cfg.method!r}: use 'eagle' or 'ngram'")
        if cfg.method == "eagle" and not cfg.model:
            raise ValueError("speculative_config method='eagle' needs model=<drafter dir> "
                             "(build one with `tlt train-drafter`), or use method='ngram'")
        if cfg.bs_threshold is not None and cfg.bs_threshold < 1:
            raise ValueError(f"speculative_config bs_threshold={cfg.bs_threshold}: use an integer >= 1 or None")
        if cfg.acceptance not in ("invariant", "rejection"):
            raise ValueError(f"speculative_config acceptance={cfg.acceptance!r}: use 'invariant' or 'rejection'")
        if not 0 <= cfg.epsilon <= 1:
            raise ValueError(f"speculative_config epsilon={cfg.epsilon}: use a value in [0, 1]")
        if cfg.num_speculative_tokens < 1:
            raise ValueError("speculative_config num_speculative_tokens must be >= 1")
        return cfg

    def arm_table(self, has_drafter: bool, device_type: str):
        """(bucket upper bounds, arms per bucket) for the bandit; eagle arms only with a drafter."""
        import math

        from tlt.speculative.bandit import OFF, Arm, default_arm_table
        if not self.adaptive:
            k = self.num_speculative_tokens
            if self.method == "ngram":
                arm = Arm(f"ngram{k}", "ngram", depth=k, num_draft_tokens=k)
            elif self.draft_topk == 1:
                arm = Arm(f"chain{k}", "eagle_chain", depth=k, topk=1, num_draft_tokens=k)
            else:
                n = self.num_draft_tokens or k * self.draft_topk
                arm = Arm(f"tree{k}x{self.draft_topk}n{n}", "eagle_tree", depth=k, topk=self.draft_topk,
                          num_draft_tokens=n)
            return [math.inf], [[arm]]
        profile = self.device_profile if self.device_profile != "auto" else ("gpu" if device_type == "cuda" else "cpu")
        bounds, table = default_arm_table(profile)
        keep = (lambda a: True) if has_drafter else (lambda a: not a.method.startswith("eagle"))
        return bounds, [[a for a in arms if keep(a)] or [OFF] for arms in table]

    def max_draft_len(self) -> int:
        """Upper bound on positions one verify step writes past a sequence's end (for cache headroom)."""
        return max(64, 2 * self.num_speculative_tokens, self.num_draft_tokens or 0)

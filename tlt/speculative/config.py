"""SpecConfig: the one speculative-decoding config, written as the `speculative` section of a run config
(`speculative.bs_threshold=16`) or passed to `tlt.LLM(speculative_config={...})`, with vLLM's key names where the
meaning matches. Both ways go through the same field types, bounds and cross-key checks (tlt.schema).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from tlt.schema import ConfigError, close_matches_hint, option, set_option


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
    bs_threshold: int | None = option(32, "SD only while the running batch <= this; null = always on", ge=1)
    hysteresis_steps: int = option(4, "consecutive decode steps under bs_threshold before SD turns on", ge=1)
    adaptive: bool = option(True, "a bandit picks the arm (method, depth, tree) per batch-size bucket; false = the "
                                  "one fixed arm below")
    draft_topk: int = option(1, "fixed arm: 1 = chain of num_speculative_tokens, > 1 = EAGLE-2 tree", ge=1)
    num_draft_tokens: int | None = option(None, "fixed tree arm: verify budget; null = depth * topk", ge=1)
    device_profile: Literal["auto", "cpu", "gpu"] = option(
        "auto", "arm table: cpu (small verify budgets) or gpu (larger trees); auto = by the engine's device")
    epsilon: float = option(0.1, "bandit exploration probability", ge=0, le=1)
    window: int = option(300, "bandit sliding window (steps) for each arm's tokens/s estimate", ge=1)
    close_buckets: bool = option(True, "a batch-size bucket where SD lost time (net of the hidden-state capture) and "
                                       "plain decoding is the bandit's choice decodes plainly, without exploring "
                                       "or capturing hidden states, until it probes again (probe_closed) or a new "
                                       "drafter is published; in a bucket that stays open, the learned drafter's "
                                       "arms retire alike where they lost (docs/design.md §6)")
    probe_closed: float = option(0.01, "a closed bucket opens again to probe, every SD arm tried afresh (the "
                                       "learned drafter's, where they retired, wait for their own probe, counted "
                                       "alike from what they lost), once it has "
                                       "decoded plainly for 1 / probe_closed times the seconds SD lost there before "
                                       "it closed, sooner where the n-gram drafter, asked rows' next tokens each "
                                       "plain step, keeps guessing them (a repetitive tail): where SD never pays, "
                                       "the bucket's probes cost about this fraction of its time, and its retired "
                                       "drafter arms' as much again. 0 = only a new drafter reopens it "
                                       "(docs/design.md §6)",
                                 ge=0, le=0.5)
    probe_backoff: int = option(4, "each probe in a row that finds SD still not paying doubles the next wait of "
                                   "its bucket (and that of the learned drafter's retired arms), up to 2 ** "
                                   "probe_backoff times the wait its loss sets; a probe where SD pays or a new drafter "
                                   "that reopens the closed bucket starts it again, and while the n-gram drafter "
                                   "guesses half or more of the rows' next tokens or a row loops the wait is the "
                                   "first one's, until a probe begun there finds nothing. 0 = "
                                   "every wait as long as the first "
                                   "(docs/design.md §6)", ge=0)
    follow_loops: int | None = option(
        None, "a row loops once the n-gram drafter, asked at plain steps with no request waiting for the next "
              "token of up to 4 rows a step (in turn), has guessed its next token this many times in a row; while a "
              "row of the batch loops, its batch-size bucket, open or closed, runs its n-gram arm whatever the arm's "
              "average says, until a step where that row gains no drafted token, a guess about it misses or it "
              "finishes; those steps do not count in the arm's average. 0 = off; null = 4 with the cpu profile, off "
              "with the gpu one (its cost on a GPU is unmeasured; docs/design.md §6)", ge=0)
    acceptance: Literal["invariant", "rejection"] = option(
        "invariant", "invariant = deterministic drafts, the target's own draw accepted when a draft holds it (a "
                     "seeded request samples the same tokens with SD on or off); rejection = chain drafts sampled "
                     "from the drafter, Leviathan/Chen rejection sampling (the same law, other samples; accepts "
                     "more where the target is spread out, temperature ~1); docs/design.md §7")
    ngram_max_n: int = option(4, "n-gram drafter: longest suffix matched", ge=1)
    ngram_min_n: int = option(2, "n-gram drafter: shortest suffix matched", ge=1)
    seed: int = option(0, "seed of the bandit's exploration and of a fresh drafter (a run sets trainer.seed)")

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
        if self.ngram_min_n > self.ngram_max_n:
            raise ConfigError(f"{prefix}ngram_min_n={self.ngram_min_n} must be <= {prefix}ngram_max_n="
                              f"{self.ngram_max_n}")

    def engine_config(self, seed: int) -> dict[str, Any] | None:
        """`tlt.LLM(speculative_config=...)` for a run: every key, with the run's seed (None when disabled)."""
        if not self.enabled:
            return None
        return {**dataclasses.asdict(self), "seed": seed}

    def arm_table(self, has_drafter: bool, device_type: str):
        """(bucket upper bounds, arms per bucket) for the bandit; eagle arms only with a drafter."""
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
        bounds, table = default_arm_table(self.profile(device_type))
        keep = (lambda a: True) if has_drafter else (lambda a: not a.method.startswith("eagle"))
        return bounds, [[a for a in arms if keep(a)] or [OFF] for arms in table]

    def profile(self, device_type: str) -> str:
        """The device profile the arm table and the loop following use: device_profile, or by the engine's device."""
        return self.device_profile if self.device_profile != "auto" else ("gpu" if device_type == "cuda" else "cpu")

    def follow(self, device_type: str) -> int:
        """follow_loops, or by the profile where it is null: 4 on a CPU; off on a GPU, where its cost a plain step
        (tens of microseconds) has not been measured against a step of a few milliseconds."""
        if self.follow_loops is not None:
            return self.follow_loops
        return 4 if self.profile(device_type) == "cpu" else 0

    def max_draft_len(self) -> int:
        """Upper bound on positions one SD step writes past a sequence's end: the verified tree in the target's cache,
        the eager draft (depth x top-k) and a catch-up pass in the drafter's (for cache headroom)."""
        k = self.num_speculative_tokens
        return max(64, 2 * k, self.num_draft_tokens or 0, k * self.draft_topk)  # the eager draft writes depth x top-k

    def cache_headroom(self) -> int:
        """Positions past a sequence's worst-case length that its steps may write (a verified tree and the root; the
        drafter's padded catch-up): reserved in the KV caches at admission and in each row's hidden-state record."""
        return self.max_draft_len() + 1

"""The adaptive speculation policy: per batch-size bucket, the arm with the best measured speed (docs/design.md §6).

A pure object of what it observed. Each decode step the engine asks `choose(batch_size)` for an arm (a drafting
strategy, or "off": plain decoding) and reports `observe(batch_size, arm, tokens, seconds, nested)`: the tokens the
step emitted over its rows, its cost on the engine's clock, and what each arm nested in it (`nested_in`) would have
emitted on the same text. Time is injected; nothing here reads a clock.

An arm's value is its speed relative to plain decoding at the same batch sizes over its last `window` steps (plain
steps' costs: PlainCosts). Choice, at or below `bs_threshold` ("off" above): a trial for an arm with under
`min_steps` steps and `min_rows` rows on record, in table order; "off" where the price it judges by is missing or
`refresh` choices old; else the highest UCB score, value x (1 + explore * sqrt(ln(1 + n) / its steps)). Parking is
the one mechanism for anything that stopped paying: an SD arm below 1 waits, unchosen, until its bucket has decoded
n / `probe` times what its probe (a fresh trial) loses, doubled per losing probe up to 2 ** `backoff`, or until
published drafters' gains (`drafter_changed`) would make it pay. `explain()` says per bucket and arm what the
record holds and why it runs or not.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

METHODS = ("eagle_chain", "eagle_tree", "ngram", "off")
DRAFTER_METHODS = ("eagle_chain", "eagle_tree")  # the arms that draft with the learned drafter
PRICE_STEPS = 8  # plain steps at a batch size whose median prices a plain step there
PRIOR_STEPS = 4  # a new drafter's arms keep their last steps with the old one as a prior


@dataclass(frozen=True)
class Arm:
    name: str
    method: str                # one of METHODS
    depth: int = 0             # drafting steps (tree depth / chain length)
    topk: int = 1              # children expanded per node (trees)
    num_draft_tokens: int = 0  # verify budget: draft tokens sent to the target per row (root excluded)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"arm {self.name!r}: method {self.method!r} is not one of {METHODS}")


OFF = Arm("off", "off")


class PlainCosts:
    """A plain step's seconds by batch size, from every plain step (above bs_threshold too): at bs, the median of the
    last PRICE_STEPS plain steps at batch sizes within a quarter of bs (one slow step, a process's first at a batch
    size, does not set a price); linear between those, and past the largest along the slope of the upper half of
    them (never falling). It prices an arm's tokens."""

    def __init__(self):
        self.steps: dict[int, deque] = {}
        self.sizes: list[int] = []  # the measured batch sizes, sorted
        self._cache: dict[int, float] = {}

    def add(self, bs: int, seconds: float) -> None:
        if bs not in self.steps:
            bisect.insort(self.sizes, bs)
        self.steps.setdefault(bs, deque(maxlen=PRICE_STEPS)).append(seconds)
        for b in [b for b in self._cache if abs(b - bs) <= max(1, b // 4)]:  # the prices this step is near
            del self._cache[b]

    def __contains__(self, bs: int) -> bool:
        return bs in self.steps

    def __bool__(self) -> bool:
        return bool(self.steps)

    def at(self, bs: int) -> float:
        """The median plain step near a measured batch size bs."""
        if bs not in self._cache:
            r = max(1, bs // 4)
            near = sorted(x for b in range(bs - r, bs + r + 1) for x in self.steps.get(b, ()))
            self._cache[bs] = near[(len(near) - 1) // 2]
        return self._cache[bs]

    def __call__(self, n: float) -> float:
        if n in self.steps:
            return self.at(n)
        xs = self.sizes
        i = bisect.bisect_left(xs, n)
        if i == 0:
            return self.at(xs[0])
        if i < len(xs):
            lo, hi = xs[i - 1], xs[i]
            return self.at(lo) + (n - lo) / (hi - lo) * (self.at(hi) - self.at(lo))
        top = [x for x in xs if x >= xs[-1] / 2]
        mean = sum(top) / len(top)
        var = sum((x - mean) ** 2 for x in top)
        slope = sum((x - mean) * self.at(x) for x in top) / var if var else 0.0
        return self.at(xs[-1]) + max(slope, 0.0) * (n - xs[-1])


@dataclass
class ArmRecord:
    """One arm in one bucket: its last steps and its parking."""
    arm: Arm
    steps: deque  # (bs, tokens, seconds), its own or read off a nesting arm's
    own: deque    # its own steps' (plain price, seconds): what a step costs it
    pairs: dict = field(default_factory=dict)  # nesting arm -> deque of (its tokens, that arm's) on that arm's steps
    chosen: int = 0
    parked_for: float | None = None  # seconds its bucket decodes before its probe; None: active
    waited: float = 0.0              # seconds its bucket decoded since it was parked
    parked_value: float = 0.0        # its value when parked
    grown: float = 1.0               # its drafter's accept-length growth since then (drafter_changed's gains)
    misses: int = 0                  # probes in a row that found it losing
    probing: bool = False            # active for a probe (judged at the end of its trial)

    @property
    def rows(self) -> int:
        return sum(bs for bs, _, _ in self.steps)

    def cost(self) -> float | None:
        """Its steps' seconds over plain steps' at their batch sizes (None before one of its own)."""
        return sum(s for _, s in self.own) / sum(p for p, _ in self.own) if self.own else None

    def keep_last(self, n: int) -> None:
        for d in (self.steps, self.own, *self.pairs.values()):
            while len(d) > n:
                d.popleft()

    def pair(self, head: Arm, tokens: float, head_tokens: float) -> None:
        self.pairs.setdefault(head, deque(maxlen=self.steps.maxlen)).append((tokens, head_tokens))

    def ratio(self, head: Arm) -> float | None:
        """Its tokens over the nesting arm's on that arm's recent steps (None before one)."""
        d = self.pairs.get(head)
        return sum(t for t, _ in d) / max(sum(h for _, h in d), 1e-12) if d else None

    def unpark(self) -> None:
        """A probe: active again with an empty record (a fresh trial)."""
        self.keep_last(0)
        self.parked_for, self.probing, self.grown = None, True, 1.0


@dataclass
class Bucket:
    lo: int
    hi: float
    arms: list[ArmRecord]
    choices: int = 0      # choices made there (the exploration bonus's log)
    since_off: int = 0    # choices since "off" was chosen (refresh)

    @property
    def name(self) -> str:
        if self.hi == math.inf:
            return f"bs>={self.lo}"
        return f"bs{self.lo}" if self.lo == self.hi else f"bs{self.lo}-{int(self.hi)}"


class AdaptivePolicy:
    def __init__(self, bounds: Sequence[float], arms: Sequence[Sequence[Arm]], bs_threshold: int | None = None,
                 explore: float = 0.25, window: int = 32, min_steps: int = 4, min_rows: int = 16, refresh: int = 64,
                 probe: float = 0.01,
                 backoff: int = 4):
        if len(bounds) != len(arms) or list(bounds) != sorted(bounds) or bounds[-1] != math.inf:
            raise ValueError(f"bounds must increase to inf, one list of arms each; got {list(bounds)}")
        for table in arms:
            names = [a.name for a in table]
            if not table or len(set(names)) != len(names):
                raise ValueError(f"a bucket needs at least one arm and unique names, got {names}")
        self.bs_threshold, self.explore = bs_threshold, explore
        self.min_steps, self.min_rows = min_steps, min_rows
        self.refresh, self.probe, self.backoff = refresh, probe, backoff
        self.price = PlainCosts()
        self.buckets = [Bucket(1 if i == 0 else int(bounds[i - 1]) + 1, hi,
                               [ArmRecord(a, deque(maxlen=window), deque(maxlen=window)) for a in table])
                        for i, (hi, table) in enumerate(zip(bounds, arms))]

    def bucket(self, bs: int) -> Bucket:
        return next(b for b in self.buckets if bs <= b.hi)

    def value(self, rec: ArmRecord) -> float:
        """The arm's speed relative to plain decoding over its record; -inf before a priced step."""
        if rec.arm.method == "off":
            return 1.0
        if not rec.steps or not self.price:
            return -math.inf
        per_row: dict[int, float] = {}  # tokens a row, by batch size (each priced once)
        for bs, tokens, _ in rec.steps:
            per_row[bs] = per_row.get(bs, 0.0) + tokens / bs
        return sum(t * self.price(bs) for bs, t in per_row.items()) / max(sum(s for *_, s in rec.steps), 1e-12)

    def plain_seconds(self, bs: int, tokens: float) -> float | None:
        """What plain decoding takes for `tokens` emitted at batch size bs; None before any plain step."""
        return tokens / bs * self.price(bs) if self.price else None

    # ---- choosing ---------------------------------------------------------------------------------------------
    def choose(self, bs: int) -> Arm:
        if self.bs_threshold is not None and bs > self.bs_threshold:
            return OFF
        b = self.bucket(bs)
        off = off_in(b)
        active = [r for r in b.arms if r.parked_for is None]
        rec = next((r for r in active if not self._tried(r)), None)  # a trial
        if rec is None:
            rec = max(active, key=lambda r: self.score(b, r))
        if off is not None and rec is not off and (bs not in self.price or b.since_off >= self.refresh):
            rec = off  # keep the price it is judged by current
        b.choices += 1
        b.since_off = 0 if rec is off else b.since_off + 1
        rec.chosen += 1
        return rec.arm

    def _tried(self, rec: ArmRecord) -> bool:
        """Whether the record holds a trial's worth: min_steps steps or min_rows rows."""
        return len(rec.steps) >= self.min_steps or rec.rows >= self.min_rows

    def score(self, b: Bucket, rec: ArmRecord) -> float:
        """value x (1 + explore * sqrt(ln(1 + n) / its steps)), n the bucket's choices: an arm with few steps on record
        is chosen until they say it is worse (UCB); "off", the reference, gets no bonus and wins ties."""
        if rec.arm.method == "off":
            return 1.0
        return self.value(rec) * (1.0 + self.explore * math.sqrt(math.log(1 + b.choices) / max(len(rec.steps), 1)))

    def _best(self, active: list[ArmRecord], off: ArmRecord | None) -> ArmRecord:
        best = max(active, key=self.value)
        return off if off is not None and self.value(best) <= 1.0 else best

    # ---- observing ----------------------------------------------------------------------------------------------
    def nested(self, bs: int, arm: Arm) -> list[Arm]:
        """The arms whose tokens on a step of `arm` at bs observe wants (`nested`): its bucket's nested in it."""
        if self.bs_threshold is not None and bs > self.bs_threshold:
            return []
        return [r.arm for r in self.bucket(bs).arms if nested_in(r.arm, arm)]

    def observe(self, bs: int, arm: Arm, tokens: float, seconds: float,
                nested: dict[Arm, float] | None = None) -> None:
        """A step of `arm` at batch size bs emitted `tokens` over its rows in `seconds`; nested: the tokens each arm
        nested in it would have emitted on this step (the same text: arms are compared on the same steps)."""
        if arm.method == "off":
            self.price.add(bs, seconds)
        if self.bs_threshold is not None and bs > self.bs_threshold:
            return
        b = self.bucket(bs)
        for r in b.arms:
            if r.parked_for is not None:
                r.waited += seconds
                if r.waited >= r.parked_for:
                    r.unpark()
        rec = next(r for r in b.arms if r.arm == arm)
        rec.steps.append((bs, tokens, seconds))
        if self.price:
            rec.own.append((self.price(bs), seconds))
        for r in b.arms if arm.method != "off" and self.price else ():
            cost = r.cost()
            if r.arm in (nested or ()):
                r.pair(arm, nested[r.arm], tokens)
            if r.parked_for is not None or cost is None:
                continue
            if r.arm in (nested or ()):  # what it would have emitted here, at its own steps' cost
                r.steps.append((bs, nested[r.arm], cost * self.price(bs)))
            elif nested_in(arm, r.arm) and rec.ratio(r.arm):  # the nesting arm's tokens here by their recent ratio
                r.steps.append((bs, tokens / rec.ratio(r.arm), cost * self.price(bs)))
        if arm.method != "off" and self._tried(rec) and off_in(b):
            self._judge(rec, sum(r.arm.method != "off" for r in b.arms))

    def _judge(self, rec: ArmRecord, arms: int) -> None:
        """Park an SD arm that loses to plain decoding (its probes, and its bucket's `arms` SD arms' together, cost
        about `probe` of the bucket's time); end a probe's back-off where it pays."""
        value = self.value(rec)
        if value >= 1.0:
            if rec.probing:
                rec.probing, rec.misses = False, 0
            return
        if rec.probing:
            rec.misses += 1
        # what a probe (a trial) loses: its own steps' mean seconds, over a trial's steps at its mean batch size
        trial = min(self.min_steps, math.ceil(self.min_rows * len(rec.steps) / max(rec.rows, 1)))
        lost = sum(s for _, s in rec.own) / max(len(rec.own), 1) * trial * (1.0 - max(value, 0.0))
        wait = lost * arms / self.probe if self.probe else math.inf
        rec.parked_for, rec.waited, rec.probing = wait * 2 ** min(rec.misses, self.backoff), 0.0, False
        rec.parked_value, rec.grown = value, 1.0

    def drafter_changed(self, gain: float | None = None) -> None:
        """A new drafter, accepting (1 + gain) times the tokens the old one did (None: unknown): its arms keep their
        last PRIOR_STEPS steps (so their exploration bonus grows again), and a parked one probes now if the growth
        since it was parked would make it pay (always, where unknown)."""
        for b in self.buckets:
            for r in b.arms:
                if r.arm.method not in DRAFTER_METHODS:
                    continue
                r.keep_last(PRIOR_STEPS)
                if r.parked_for is not None:
                    r.grown = math.inf if gain is None else r.grown * max(1.0 + gain, 0.0)
                    if r.parked_value * r.grown >= 1.0:
                        r.unpark()
                        r.misses, r.probing = 0, False

    # ---- reading ------------------------------------------------------------------------------------------------
    def parked_buckets(self) -> list[str]:
        """Buckets that decode plainly because every SD arm there is parked."""
        return [b.name for b in self.buckets if off_in(b) and len(b.arms) > 1
                and all(r.parked_for is not None for r in b.arms if r.arm.method != "off")]

    def explain(self) -> dict[str, dict[str, dict]]:
        """{bucket: {arm: {steps, value, score, chosen, state}}}: what each arm's record holds and why it runs or
        not ("best": the highest value; choose adds the exploration bonus, the score)."""
        out = {}
        for b in self.buckets:
            best = self._best([r for r in b.arms if r.parked_for is None], off_in(b))
            out[b.name] = {r.arm.name: {
                "steps": len(r.steps), **{k: None if math.isinf(v) else round(v, 3)  # never ran: no value
                                          for k, v in (("value", self.value(r)), ("score", self.score(b, r)))},
                "chosen": r.chosen,
                "state": ("best" if r is best else "active") if r.parked_for is None else
                f"parked: probe in {max(r.parked_for - r.waited, 0):.3g} s (after {r.misses} misses)"}
                for r in b.arms}
        return out


def nested_in(b: Arm, a: Arm) -> bool:
    """Whether arm b's drafts are among arm a's on every step, so that a's verdict says what b would have emitted:
    both draft with the drafter, b no deeper and of no larger budget, and b a chain (the drafter's argmax chain,
    DraftTree.greedy) or a tree of a's top-k (its budget's best nodes, DraftTree.rank)."""
    return (b != a and b.method in DRAFTER_METHODS and a.method in DRAFTER_METHODS and b.depth <= a.depth
            and b.num_draft_tokens <= a.num_draft_tokens and b.topk in (1, a.topk))


def off_in(b: Bucket) -> ArmRecord | None:
    """The bucket's "off" arm (a fixed-arm table has none: nothing to price or park against)."""
    return next((r for r in b.arms if r.arm.method == "off"), None)

"""BEG-MAB: a bucketed epsilon-greedy bandit that picks the drafting strategy per decode step (docs/design.md §6).

Arms are grouped by running-batch-size bucket (buckets given by inclusive upper bounds, e.g. [1, 4, 20, inf]).
Every bucket holds an "off" arm (plain decoding) so the policy can learn that SD does not pay at large batch.
In a bucket: untried arms first (in table order); then with probability epsilon a random arm, else the best arm.

Where this departs from the paper's BEG-MAB (median per-step reward, uniform exploration), and why:
- Estimate = throughput over the arm's last `window` steps as a ratio of sums, not the median of per-step
  rewards. The median ignores the rare expensive steps (a drafter catch-up after a stretch of plain decoding, a
  deep tree's spike) and the rare long accepts, so it ranks arms by their typical step rather than by the tokens
  per second they actually deliver; the ratio of sums is what a rollout's wall time depends on.
- Throughput is measured against plain decoding at the step's own batch size: a step at batch size bs that emits
  `tokens` in `seconds` counts tokens / bs * t_off(bs) "plain seconds", t_off(bs) being the lower median of the "off"
  arm's last PRICE_STEPS (8) steps at that batch size in its window (at the nearest batch size it ran in the bucket
  otherwise). An arm's estimate sum(plain seconds) / sum(seconds) over its window is a speedup over plain decoding;
  "off"'s is its steps' plain seconds over their price, 1.0 (a plain step emits one token a row). Raw tokens/s would
  compare arms measured at different batch sizes of one bucket: at bs 2-4 a decode step costs about the same at
  either end, so whichever arm happened to run at bs 4 looked twice as fast as one that ran at bs 2.
- Every arm is priced at the same, recent plain step time: a bucket's windows are priced again at "off"'s current step
  times at each of its first `reprice_every` (16) "off" steps and every 16th after (every bucket's, for an "off" step
  at bs 1, the fixed part below), and at each "off" step run to refresh the price where an SD arm is the greedy
  choice (`refresh`, below), not frozen at the time known when each step was recorded. Each of the first 16
  counts because a bucket where SD pays sees few "off" steps: priced at its first alone, a cold first step set the
  price for a whole run (docs/design.md §6). Frozen, an SD step kept the t_off of its moment for its whole window: at
  bs 2 on a 2-core CPU the first plain steps of a process ran 13-16 ms and the later ones 10-11 ms, so a chain at
  0.87x of plain decoding was recorded at 1.01x against "off"'s 0.94x and held 65% of the steps for hundreds of
  steps. Repricing at every "off" step instead cost O(batch sizes in the window) a step: about 250 us a step at bs
  21-200 with the GPU table, against 30 us now. Where SD is chosen "off" runs only every 32nd choice, so at every
  16th of those the SD steps of ~500 choices were valued at the plain step of long ago: at bs 1 a 2-core VM's plain
  step drifted by a fifth between rounds of `tlt bench spec`, and an n-gram arm at accept length 1.06 ran 93% of a
  round's steps on a stale price. Each refresh reprices at once (one every 32 choices).
- The price must not rest on one step, nor on old ones. A mean let one cold step set it: in a default run the first
  plain step at bs 22 took 3.1 s (the next ones 30-60 ms), the n-gram arm at bs 21-32 then looked 40x faster, ran on
  every step there, "off" never ran there again, and the ledger claimed more seconds saved than the rollouts took
  (docs/design.md §6). So the price is a lower median; an SD arm is chosen greedily only where "off"'s window holds
  two steps at that batch size ("off" runs instead until it does); and "off" runs at least once every `refresh` (32)
  choices of an open bucket. Where SD pays x times plain decoding those steps cost (1 - 1/x) / refresh of the
  bucket's time. "off" is 1.0 by its own price, so its slow steps do not make an SD arm look faster than it is; an SD
  arm's slow steps still count against it (the safe side).
- Where no request waits for a slot, the batch can only shrink, and its rollout ends when the row with the most tokens
  left to its limit does (the critical row). Then a step's tokens are worth what they save of that: a plain step's
  cost t_off(bs) splits into a fixed part, min(t_off(1), t_off(bs)) (the weights read once a step), and (bs - 1) equal
  parts per row; the critical row's tokens are priced at the fixed part, the others' at the per-row part. A plain step
  is worth itself either way; where the cost is proportional to the batch this is the price above. At bs 2 on a 2-core
  CPU a plain step costs the same as at bs 1: a chain step gave the rows 1.57 tokens on average but the critical row
  1.28 (the row behind is behind because it accepts less), so priced by the average it looked 1.06x and took up to 65%
  of the steps, while `tlt bench spec` at bs 2 ran 0.72-0.83x of plain decoding's speed, the lagging row finishing
  alone at bs 1. Where a request waits, a finished row's slot is refilled and every token counts alike. Rows that stop
  at EOS before their limit make the critical row a guess: the row furthest from its limit. The caller's `critical`
  is how many tokens nearer that end a step came (the most tokens a row had left, less the most any row has left
  after it), not what the furthest row gained: where it gained 3 and the row one behind it 1, the end came 2 nearer.
- "off" is kept unless an SD arm beats it by `min_gain` (a tie costs SD's variance for nothing).
- An arm is untried until a step of it is recorded, and an SD step is recorded only once its bucket has an "off"
  step to measure it against. The caller leaves out steps that captured a CUDA graph (tlt.speculative.spec_decoder):
  timed with a capture, one plain step on an H100 made every SD arm look 30x faster; left out without these
  rules, "off" had no step at all and the 1 s fallback made them look 100x faster.
- Exploration skips arms that are confidently dominated (>= `min_samples` steps and below the best by more than
  `margin`, or any steps and below `far` (0.5) times the best: an arm at half the best's speed or less is not
  noise) except with probability `recheck`, so once SD is known not to pay, exploring costs ~epsilon * recheck
  of the steps instead of ~epsilon. Without `far`, each arm of a fresh bandit ran min_samples steps before it
  could be skipped: at bs 5-20 on a CPU, about 20 steps at 2-3x a plain step's cost in the first rollout.
- A new drafter (`forget`, called when one is published) shortens the learned-drafter arms' windows to their last
  `min_samples` steps instead of wiping them: a prior that the new drafter's own steps outweigh within a few
  steps. Online publishes come every RL step and move acceptance a little (the publish gate refuses a drafter that
  scores worse on held-out data); wiping made every EAGLE arm of every bucket untried again after each one, so
  each rollout re-ran its costliest arms (deep trees at bs 5-20) about 20 times for no information.
- Exploration decays: a bucket explores with probability epsilon * window / (window + n), n = its steps since the
  last `forget`. An arm just inside the margin (an n-gram arm at 0.85-0.9x of "off", say) is otherwise explored on
  a steady share of the steps forever; a new drafter restarts the count, since that is when arms change.
- A bucket closes when SD has not paid there (docs/design.md §6, "closing"): every arm tried, "off" the greedy
  choice, and the bucket's ledger negative: the seconds its SD steps saved against plain decoding, minus the seconds
  spent there keeping hidden states for the drafter (`charge`), over the last `window` steps. A closed bucket
  decodes plainly without exploring, and its steps keep no hidden states (`capturing`). A new drafter (`forget`)
  reopens every bucket, or, given its gain in accept length over the old one, only the closed buckets where a
  drafter arm that much faster would beat "off": on a 2-core CPU a depth-1 chain step costs 1.5-1.7x a plain one
  at bs 2-16, so a 10% better drafter cannot pay there, and reopening cost the next rollout its exploration
  again. Without closing, exploration and the rechecks of dominated arms cost a steady share of SD steps that
  lose, and the capture costs every step, in buckets where SD never pays.
- A closed bucket also opens again by itself to probe (`probe`, 0.01): once plain decoding there has taken
  1 / probe times the seconds SD lost there (its ledger, over the last `window` steps, when it closed), and at least
  SHADOW (16) plain steps, with its SD arms' windows emptied, so each is tried afresh. Where SD never pays, the probes
  cost about `probe` of the bucket's time, and the retired drafter arms' own probes (below) as much again (at 0.05,
  `tlt bench spec` lost 2-6% at bs 1-32 on a 2-core CPU; at 0.02, 0.95-1.01x of plain decoding at bs 4 in nine
  runs on two CPUs, where rows that all run to the limit together leave SD nothing to gain); where it starts to pay,
  SD gets its chance without waiting for a drafter. A probe that finds SD still losing (the bucket
  closes again) doubles the next wait, up to 2 ** `backoff` (4: 16x) times the first, and the retired drafter arms'
  own probes back off alike: on `tlt bench spec` each probe at bs 8 ran 15-25 SD steps at 1.3-2x a plain step's
  cost (every arm tried afresh, then min_samples steps each before it could close again), about 0.25 s in a 2.6 s
  round, and at a steady `probe` of 0.02 those episodes came every few rounds. A probe where SD pays or a new
  drafter that reopens the bucket starts the waits again; while the shadow's hit rate is half or more (the text
  repeats: news no probe has seen) the wait is the first one's.
  What pays changes with the text, not only with the drafter: in a default run three of the four buckets closed in
  the short-tailed first steps, and later steps ended in rows looping to the length limit, where n-gram drafts held
  about 4-4.6 tokens a step (docs/design.md §6). Without probing, a closed bucket reopens only for a new drafter.
- The wait for a probe is shorter where the text repeats: at each plain step a closed bucket with an n-gram arm asks
  the n-gram drafter for the next token of up to four rows where no request waits, one where one does (rows in turn;
  `NgramDrafter.propose` with k = 1, which may differ from a longer draft's first token), and at a hit rate h over the
  last 16 asked the wait is max(1 - h, 1/8) of the above: once the rows asked keep hitting, an eighth of it (at
  `probe` 0.01 a loop is probed as early as with a quarter at 0.02, and a blind probe costs half). A false alarm costs
  at most 8 times `probe`. Not 1 - h ** d, as if a d-token draft's tokens held independently: in a loop they hold
  together, and that wait missed the loops (docs/design.md §6). One row that loops is enough, however few of the
  others hit: with `follow` on, a row whose last `follow` guesses held brings the wait to its eighth, without back-off
  (the rate over all rows stayed under a half at bs 2-4 with one looping row), and is followed there as in an open
  bucket (below).
- A bucket stays open while any SD arm pays there, and on a 2-core CPU what paid was the n-gram arm in looping tails
  while the EAGLE arms lost in every bucket; open, the bucket kept exploring them and keeping hidden states for them,
  and each publish restarted that. So the learned drafter's arms retire on their own (`_retire_if_lost`: each with
  `min_samples` steps or dominated, none beating "off" by min_gain, their steps together slower than plain decoding
  of their tokens), in an open bucket and in one that closes: not chosen, not explored, no hidden states kept for
  them (`capturing`). A probe of a closed bucket then tries its other SD arms afresh; the drafter's arms return for a
  drafter whose gain could pay (`forget`) or by their own probe, once the bucket decoded 1 / `probe` times the seconds
  they lost (at least SHADOW steps).
- A bucket follows a loop (`follow`, 4): where no request waits, each plain step asks the n-gram drafter for the next
  token of up to four rows (in turn; `loop_shadow`, or `shadow` in a closed bucket), and a row whose next token it
  guessed `follow` times in a row loops. While a row of the batch loops, the bucket runs its n-gram arm whatever its
  window says, until a step where that row gains no drafted token (`loop_drafted`) or it finishes; only guesses start
  a loop, and "off" still runs where its price would go stale. A closed bucket follows too, and stays closed (its
  probe counts plain steps only): it closed on what SD was worth before the loop began, as bs 2-4 did in the
  short-tailed second step of default runs, and a false alarm costs one n-gram step. In a looping tail n-gram drafts
  hold 3-4.6 tokens a step while the arm's window, over the rest of the rollout, says it loses: in one of three
  default runs on an AVX2 CPU exploration went elsewhere and the loop that saved 1.1-2.0 s in the other two was
  decoded plainly. Any looping row, not only the critical ones: a looping row runs to its limit, while the rows the
  rollout seems to wait for (the furthest from theirs) may stop at EOS first, and once a loop's drafts pull its rows
  ahead those are the others; asking about the critical rows alone followed 0-3 steps a rollout and missed a loop
  (docs/design.md §6). But a step follows only the looping rows with more tokens left than every row that does not
  loop (`left`): where another row outlasts them, their drafts bring the batch's end no nearer. With AMX (a plain step
  at bs 10 costs about one at bs 1) a default run's fourth rollout followed 26 steps of rows that others outlasted,
  and SD off's batch, which ended with 8 or more rows running, became a tail at bs 1-4: 21.1 s of decoding against
  18.0 s.
- What the n-gram arm is worth depends on the text: a new batch (`new_batch`, called when requests arrive at an idle
  engine: the next rollout) cuts its windows to their last `min_samples` steps, as a new drafter does the drafter's
  arms' (`forget`), so its estimate follows the new text within a few steps. In a default run on an AVX2 CPU the
  fourth rollout began at bs 19-20 with ngram3's window holding the third's 22 steps at 1.27x plain decoding's worth
  and chose it greedily 16 steps in a row, no row looping, 15 of them slower than the plain decoding of their tokens
  (1.08-1.48x), before its estimate fell under "off"'s; SD off's batch ran to the limit together there, and SD's left
  a tail at bs <= 4 (docs/design.md §6).
- A followed step is recorded nowhere: not in the n-gram arm's window, not in the ledger. Those value choosing an
  arm on its record, where no row is known to loop; a loop's steps say what the arm is worth in a loop, and following
  acts on that already. Recorded, they raised the arm's estimate, and it went on being chosen after the loops ended:
  of the 22 steps above, nine were followed (together 1.63x plain decoding's worth); its other 13 made 1.07x.
"""
from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

METHODS = ("eagle_chain", "eagle_tree", "ngram", "off")
SD_METHODS = tuple(m for m in METHODS if m != "off")
DRAFTER_METHODS = ("eagle_chain", "eagle_tree")  # the arms that draft with the learned drafter (and need its states)
MODEL_FREE_METHODS = tuple(m for m in SD_METHODS if m not in DRAFTER_METHODS)
SHADOW = 16  # a closed bucket's shadow n-gram steps that set its hit rate; no probe before that many plain steps
SHADOW_FLOOR = 1 / 8  # the least share of its wait a closed bucket waits where the shadow keeps hitting
PRICE_STEPS = 8  # the "off" steps at a batch size whose lower median prices a plain step there


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


def _chain(d: int) -> Arm:
    return Arm(f"chain{d}", "eagle_chain", depth=d, topk=1, num_draft_tokens=d)


def _tree(d: int, k: int, n: int) -> Arm:
    return Arm(f"tree{d}x{k}n{n}", "eagle_tree", depth=d, topk=k, num_draft_tokens=n)


def _ngram(n: int) -> Arm:
    return Arm(f"ngram{n}", "ngram", depth=n, num_draft_tokens=n)


OFF = Arm("off", "off")


def default_arm_table(device: str = "cpu") -> tuple[list[float], list[list[Arm]]]:
    """(bucket upper bounds, arms per bucket). "gpu": fastrl's table (depth 8, topk 4; verify budget by bucket
    bs 1 -> 48, 2-4 -> 32, 5-20 -> 16, >= 21 -> 8) plus chains, n-gram and off. "cpu": for a ~135M target on 2
    cores, where a verify token costs a real fraction of a decode step: chains of depth 1 and 2 (depth 1 pays first:
    one draft token, accepted about 45% of the time at temperature 0.6) below bs 21, n-gram and off. Each arm a
    bucket holds is explored again after every publish and probe, so arms that never paid on a CPU are left out
    (docs/results/spec_arms_cpu-zen4_2026-11-26.txt, docs/results/sd_price_cpu-zen4_2026-11-27.txt): no SD arm at
    bs >= 21, where every SD step of three default runs took 1.5-4.3x the plain decoding it replaced (its catch-up
    over the whole response so far, and 2-3 verify tokens a row at a batch where a token costs nearly its share of a
    step), and the tails that loop run narrower; no depth-4 chain or tree, whose steps gave 0.40-0.90x of plain
    decoding in every bucket of those runs."""
    bounds = [1, 4, 20, math.inf]
    if device == "gpu":
        budgets = [48, 32, 16, 8]
        return bounds, [[OFF, _ngram(8), _chain(4), _chain(8), _tree(8, 4, n), _tree(6, 2, max(8, n // 2))]
                        for n in budgets]
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    return bounds, [
        [OFF, _ngram(6), _chain(1), _chain(2)],
        [OFF, _ngram(4), _chain(1), _chain(2)],
        [OFF, _ngram(3), _chain(1), _chain(2)],
        [OFF],
    ]


class _Window:
    """The last `maxlen` steps as [key, tokens, critical tokens, seconds], key = (batch size, whether the step is
    valued by its critical row), with running sums per key ([steps, tokens, critical tokens, seconds]), of all
    seconds, and of the steps' plain seconds at the bandit's current prices
    (`price(key, tokens, critical)`, passed in; `reprice` when they change): an estimate reads O(1)."""

    def __init__(self, maxlen: int):
        self.entries: deque[list] = deque()
        self.maxlen = maxlen
        self.by_key: dict[tuple[int, bool], list[float]] = {}
        self.seconds = 0.0
        self.plain = 0.0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: tuple[int, bool], tokens: float, critical: float, seconds: float, price) -> None:
        if len(self.entries) == self.maxlen:
            self.drop_oldest(price)
        self.entries.append([key, tokens, critical, seconds])
        sums = self.by_key.setdefault(key, [0, 0.0, 0.0, 0.0])
        sums[0] += 1
        sums[1] += tokens
        sums[2] += critical
        sums[3] += seconds
        self.seconds += seconds
        if tokens:
            self.plain += price(key, tokens, critical)

    def add_seconds(self, seconds: float) -> None:
        """Add seconds to the newest step (a cost booked after it)."""
        entry = self.entries[-1]
        entry[3] += seconds
        self.by_key[entry[0]][3] += seconds
        self.seconds += seconds

    def drop_oldest(self, price) -> None:
        key, tokens, critical, seconds = self.entries.popleft()
        sums = self.by_key[key]
        sums[0] -= 1
        sums[1] -= tokens
        sums[2] -= critical
        sums[3] -= seconds
        if not sums[0]:
            del self.by_key[key]  # no float residue of a key that left the window
        if not self.entries:
            self.seconds = self.plain = 0.0
            return
        self.seconds -= seconds
        if tokens:
            self.plain -= price(key, tokens, critical)

    def keep_last(self, n: int, price) -> None:
        while len(self.entries) > n:
            self.drop_oldest(price)

    def reprice(self, price) -> None:
        """The plain seconds of the steps in the window at new prices, from the per-key sums: O(keys)."""
        self.plain = sum(price(key, tokens, critical) for key, (_, tokens, critical, _) in self.by_key.items()
                         if tokens)


def _steps_at(window: _Window | None, batch_size: int) -> int:
    """How many of the window's steps ran at this batch size (both keys: valued by the critical row or not)."""
    sums = window.by_key if window is not None else {}
    return sum(sums[k][0] for k in ((batch_size, False), (batch_size, True)) if k in sums)


class StrategyBandit:
    def __init__(self, bucket_bounds: Sequence[float] | None = None, arms: Sequence[Sequence[Arm]] | None = None,
                 epsilon: float = 0.1, window: int = 300, seed: int = 0, min_gain: float = 0.03,
                 margin: float = 0.15, min_samples: int = 5, recheck: float = 0.1, far: float = 0.5,
                 close: bool = True, reprice_every: int = 16, probe: float = 0.01, refresh: int = 32,
                 follow: int = 4, backoff: int = 4):
        if bucket_bounds is None and arms is None:
            bucket_bounds, arms = default_arm_table("cpu")
        if bucket_bounds is None or arms is None or len(bucket_bounds) != len(arms):
            raise ValueError("give bucket_bounds and arms together, one list of arms per bucket")
        if list(bucket_bounds) != sorted(bucket_bounds) or bucket_bounds[-1] != math.inf:
            raise ValueError(f"bucket_bounds must be increasing and end with inf, got {list(bucket_bounds)}")
        for b, bucket in enumerate(arms):
            names = [a.name for a in bucket]
            if not bucket or len(set(names)) != len(names):
                raise ValueError(f"bucket {b}: needs at least one arm and unique arm names, got {names}")
            if sum(a.method == "off" for a in bucket) > 1:
                raise ValueError(f"bucket {b}: at most one \"off\" arm (plain decoding), got {names}")
        self.bounds, self.arms = list(bucket_bounds), [list(a) for a in arms]
        self.epsilon, self.window = epsilon, window
        self.min_gain, self.margin, self.min_samples, self.recheck = min_gain, margin, min_samples, recheck
        self.far, self.close, self.reprice_every, self.probe = far, close, reprice_every, probe
        for name, value, zero in (("refresh", refresh, "never"), ("follow", follow, "never"),
                                  ("backoff", backoff, "every wait as long as the first")):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: {zero}), got {value}")
        self.refresh, self.follow, self.backoff = refresh, follow, backoff
        if not 0 <= probe <= 0.5:
            raise ValueError(f"probe must be in [0, 0.5], got {probe}")
        self.rng = random.Random(seed)
        # per bucket and arm: its last `window` steps (select() runs every SD decode step: estimates read sums)
        self.steps = [{a.name: _Window(window) for a in bucket} for bucket in self.arms]
        self.off = [next((a for a in bucket if a.method == "off"), None) for bucket in self.arms]
        # per bucket: plain decoding's step costs by batch size (_plain_costs) as of the last repricing, the "off"
        # steps since, and the price function its windows are summed with
        self._costs: list[dict[int, tuple[float, float, float]]] = [{} for _ in self.arms]
        self._off_since_reprice = [0 for _ in self.arms]
        self._off_prices: list[float | None] = [None for _ in self.arms]  # per bucket: _off_price_sum, cached
        self._refreshing = [False for _ in self.arms]  # per bucket: its latest choice was "off" to refresh the price
        self._prices = [self._price_in(b) for b in range(len(self.arms))]
        self.counts = [Counter() for _ in self.arms]   # choices per bucket and arm
        self.since_forget = [0 for _ in self.arms]     # choices per bucket since the last forget (decays epsilon)
        self.since_off = [0 for _ in self.arms]        # choices per bucket since "off" was chosen there (refresh)
        # per bucket, the ledger of the last `window` steps: the tokens and seconds of its SD steps ("off" steps
        # add none) plus the seconds charged for keeping hidden states; see ledger_seconds
        self.ledger = [_Window(window) for _ in self.arms]
        self.closed = [False for _ in self.arms]
        self.closed_gain = [1.0 for _ in self.arms]  # per bucket: accept-length growth published since it opened
        self.sd_since_open = [0 for _ in self.arms]    # SD steps recorded per bucket since it (re)opened
        # per closed bucket: plain steps and seconds decoded since it closed, and at how many seconds it reopens to
        # probe (`probe`)
        self.closed_steps = [0 for _ in self.arms]
        self.closed_plain_s = [0.0 for _ in self.arms]
        self.probe_after = [math.inf for _ in self.arms]
        self.probes = 0                                 # probes started, all buckets
        # per bucket: the probes in a row that found nothing (it closed again; each doubles the next wait, up to
        # 2 ** backoff), whether it is open for a probe not judged yet, whether that probe began where the text
        # repeated (`_repeating`), and whether one such probe among those misses found nothing
        self.probe_misses = [0 for _ in self.arms]
        self.probing = [False for _ in self.arms]
        self.probe_repeating = [False for _ in self.arms]
        self.repeat_missed = [False for _ in self.arms]
        # per closed bucket with an n-gram arm: whether the n-gram drafter would have proposed the token a row drew,
        # for its last SHADOW rows asked (up to four a plain step; `shadow`), which shortens the wait for a probe
        self.shadow_hits = [deque(maxlen=SHADOW) for _ in self.arms]
        self._has_drafter = [any(a.method in DRAFTER_METHODS for a in bucket) for bucket in self.arms]
        # per bucket: its first n-gram arm. Per row (the caller's key, `loop_shadow`): how many times in a row the
        # n-gram drafter, asked before a plain step, guessed its next token; a row at `follow` or more loops, and while
        # a row of the batch loops its bucket, open or closed, runs its n-gram arm (`select`), until a step where that
        # row gains no drafted token (`loop_drafted`) or the row finishes (`loop_end`)
        self._ngram_arm = [next((a for a in bucket if a.method == "ngram"), None) for bucket in self.arms]
        self.streak: dict[int, int] = {}
        self.loop_steps = 0                             # n-gram steps chosen that way, all buckets
        # the rows that loop where the latest `select` chose the n-gram arm for them (its caller drafts for those
        # rows only: the step is theirs), else None
        self.following: set[int] | None = None
        # per bucket: whether its learned-drafter arms are retired (they did not pay there; `_update_retired`),
        # the accept-length growth published since, the drafter steps recorded since they (re)opened, and the steps
        # and seconds decoded there since they retired with the seconds at which they are probed again
        self.retired = [False for _ in self.arms]
        self._undrafted = [[a for a in bucket if a.method not in DRAFTER_METHODS] for bucket in self.arms]
        self.retired_gain = [1.0 for _ in self.arms]
        self.drafter_since_open = [0 for _ in self.arms]
        self.retired_steps = [0 for _ in self.arms]
        self.retired_s = [0.0 for _ in self.arms]
        self.retired_probe_after = [math.inf for _ in self.arms]
        self.retired_misses = [0 for _ in self.arms]    # as probe_misses, for the retired drafter arms' own probes
        self.retired_probing = [False for _ in self.arms]

    def bucket(self, batch_size: int) -> int:
        return next(i for i, hi in enumerate(self.bounds) if batch_size <= hi)

    def select(self, batch_size: int, rows: Sequence[int] | None = None, left: Sequence[int] | None = None) -> Arm:
        """The arm for the next step at `batch_size`. rows: the batch's row keys where no request waits for a slot
        (its rollout ends with the rows it holds), which may follow a loop; None where one waits. left: each row's
        tokens left to its limit, where known: a loop is followed only for the rows the batch's end waits on."""
        b = self.bucket(batch_size)
        arms = self._active(b)
        untried = self._untried(b)
        self.following = None
        if untried and not self.closed[b]:
            arm = untried[0]
        elif rows is not None and (lead := self._following(b, rows, left)):
            # a row loops: n-gram drafts hold there, whatever the arm's window says, also in a closed bucket; "off"
            # still runs where its price would go stale (_price_stale), and that step's guesses keep the loop going
            if self._price_stale(b, batch_size):
                arm = self.off[b]
                self._refreshing[b] = True
            else:
                arm = self._ngram_arm[b]
                self.loop_steps += 1
                self.following = lead
        elif self.closed[b]:
            arm = self.off[b]  # a bucket closes only where it has an "off" arm
        elif self.rng.random() < self.epsilon * self.window / (self.window + self.since_forget[b]):
            best = self._best(b)
            live = [a for a in arms if not self._dominated(b, a.name, best)]
            arm = self.rng.choice(arms if self.rng.random() < self.recheck else live)
        else:
            arm = self._best(b)
            if arm is not self.off[b] and self._price_stale(b, batch_size):
                arm = self.off[b]  # SD chosen for its speed against a plain step's price: keep that price current
                self._refreshing[b] = True
        self.since_off[b] = 0 if arm is self.off[b] else self.since_off[b] + 1
        self.counts[b][arm.name] += 1
        self.since_forget[b] += 1
        return arm

    def _following(self, b: int, rows: Sequence[int], left: Sequence[int] | None) -> set[int] | None:
        """The looping rows a step should draft for, or None: where `left` is given, those with more tokens left than
        every row that does not loop (only their drafts can bring the batch's end nearer)."""
        if not (self.follow and self.streak and self._ngram_arm[b] is not None and self.off[b] is not None):
            return None
        loops = [self.streak.get(r, 0) >= self.follow for r in rows]
        if not any(loops):
            return None
        if left is None:
            return {r for r, loop in zip(rows, loops) if loop}
        outlasts = max((n for n, loop in zip(left, loops) if not loop), default=-1)
        return {r for r, n, loop in zip(rows, left, loops) if loop and n > outlasts} or None

    def _price_stale(self, b: int, batch_size: int) -> bool:
        """Whether "off" should run instead of the SD arm that is the greedy choice, so that the price it won on stays
        current: the bucket has chosen "off" none of the last `refresh` times, or its window holds fewer than two
        "off" steps at this batch size (one cold step would otherwise set the price there)."""
        off = self.off[b]
        if off is None or not self.refresh or not self.steps[b][off.name]:
            return False  # no "off", no refresh, or still untried (tried first anyway)
        return self.since_off[b] >= self.refresh or _steps_at(self.steps[b][off.name], batch_size) < 2

    @property
    def untried(self) -> list[list[str]]:
        """Per bucket, the arms with no step in their window, in table order: `select` tries them first. An arm
        selected but not recorded (the caller left out a step that captured a CUDA graph) stays untried."""
        return [[a.name for a in self._untried(b)] for b in range(len(self.arms))]

    def _untried(self, b: int) -> list[Arm]:
        return [a for a in self._active(b) if not self.steps[b][a.name]]

    def _active(self, b: int) -> list[Arm]:
        """Bucket b's arms that may be chosen: all but the learned-drafter arms where they are retired."""
        return self._undrafted[b] if self.retired[b] else self.arms[b]  # select runs every step: no list built

    def update(self, batch_size: int, arm: Arm, tokens: float, seconds: float, critical: float | None = None,
               followed: bool = False) -> None:
        """Record one step of `arm` run at `batch_size` (the size it was selected for): tokens emitted, seconds.
        critical: how many tokens nearer it brought the end of the batch's critical row (module doc), where no
        request waits for a slot, so that the batch can only shrink and its rollout ends with that row; None where
        one waits (a finished row's slot is refilled: every token counts alike). See the module doc.
        followed: the step ran because a row loops (`select` set `following`); it is not recorded (module doc: a
        loop's steps say what the arm is worth in a loop, not what choosing it on its record brings).
        An SD step before any "off" step of its bucket is not recorded (nothing to measure it against yet)."""
        b = self.bucket(batch_size)
        off = self.off[b]
        if followed:  # recorded nowhere, but decoding time in the bucket all the same
            self._count_retired(b, float(seconds))
            return
        if arm.method != "off" and off is not None and not self.steps[b][off.name]:
            return
        key = (batch_size, critical is not None)
        critical = 0.0 if critical is None else float(critical)
        price = self._prices[b]
        self.steps[b][arm.name].add(key, float(tokens), critical, float(seconds), price)
        sd = arm.method != "off"
        self.sd_since_open[b] += sd
        self.drafter_since_open[b] += arm.method in DRAFTER_METHODS
        if sd:
            self.ledger[b].add(key, float(tokens), critical, float(seconds), price)
        else:
            self.ledger[b].add(key, 0.0, 0.0, 0.0, price)
            self._off_since_reprice[b] += 1
            self._off_prices[b] = None
            if self._reprice_due(b, self._refreshing[b]):
                self._reprice(b)
            self._refreshing[b] = False
            if self.closed[b]:
                self.closed_steps[b] += 1
                self.closed_plain_s[b] += float(seconds)
                if self.closed_steps[b] >= SHADOW and self.closed_plain_s[b] >= self._probe_wait(b):
                    self.probes += 1
                    self.probe_repeating[b] = self._repeating(b)
                    self._reopen(b, self._probed_methods(b), keep=0, probe=True)
                    return
        if self._count_retired(b, float(seconds)):
            return
        self._update_closed(b)
        self._update_retired(b)

    def _count_retired(self, b: int, seconds: float) -> bool:
        """Count a step decoded in bucket b towards its retired drafter arms' own probe; True where the probe starts
        (they reopen, `_reopen`)."""
        if not self.retired[b]:
            return False
        self.retired_steps[b] += 1
        self.retired_s[b] += seconds
        if (self.retired_steps[b] >= SHADOW
                and self.retired_s[b] >= self.retired_probe_after[b] * self._backed_off(self.retired_misses[b])):
            self.probes += 1
            self._reopen(b, DRAFTER_METHODS, keep=0, probe=True)
            return True
        return False

    def charge(self, batch_size: int, seconds: float) -> None:
        """Book `seconds` spent at `batch_size` on the machinery SD needs on every step (keeping the target's
        hidden states for the drafter) against its bucket's ledger."""
        b = self.bucket(batch_size)
        if self.ledger[b]:
            self.ledger[b].add_seconds(seconds)
        else:
            self.ledger[b].add((batch_size, False), 0.0, 0.0, seconds, self._prices[b])
        self._update_closed(b)

    def ledger_seconds(self, b: int) -> float:
        """Bucket b's ledger over its last `window` steps: the seconds its SD steps saved against plain decoding
        (priced as the estimates are), less their own and the seconds charged."""
        return self.ledger[b].plain - self.ledger[b].seconds

    def _reprice_due(self, b: int, refreshing: bool) -> bool:
        """Whether an "off" step just recorded in bucket b reprices it: each of its window's first `reprice_every`
        "off" steps (a young window: each counts), every `reprice_every`-th after, and every one that `select` ran to
        refresh the price where an SD arm is the greedy choice (module doc): those come every `refresh` choices, and
        the SD steps between are worth what a plain step costs now, not 16 of them ago."""
        return (refreshing or self._off_since_reprice[b] >= self.reprice_every
                or len(self.steps[b][self.off[b].name]) <= self.reprice_every)

    def _reprice(self, b: int) -> None:
        """Price bucket b's windows at "off"'s current step times (every bucket's after an "off" step at the batch
        size of one, whose time is every step's fixed part): at each of the bucket's first `reprice_every` "off" steps
        (while its window holds no more), then every `reprice_every`. Between, steps are priced at the same prices, so
        each window's sum stays consistent."""
        for c in (range(len(self.arms)) if b == self.bucket(1) else [b]):
            self._costs[c] = {}
            self._off_since_reprice[c] = 0
            self._off_prices[c] = None
            for window in (*self.steps[c].values(), self.ledger[c]):
                window.reprice(self._prices[c])

    def _update_closed(self, b: int) -> None:
        """Close the bucket once SD has lost time there (ledger < 0) and the evidence says it will go on losing: an
        SD step since the bucket (re)opened (a new drafter gets its try), "off" the greedy choice, and every SD arm
        that may run (retired ones are judged already) with `min_samples` steps or below `far` times "off"."""
        if not self.close or self.closed[b] or not self.sd_since_open[b]:
            return
        best = self._best(b)
        if best.method != "off":
            if len(self.steps[b][best.name]) >= self.min_samples:  # SD pays here (not one lucky step): a probe found it
                self.probe_misses[b], self.probing[b], self.repeat_missed[b] = 0, False, False
                if best.method in DRAFTER_METHODS:
                    self.retired_misses[b], self.retired_probing[b] = 0, False
            return
        off = self.estimate(b, best.name)
        self.closed[b] = all(len(self.steps[b][a.name]) >= self.min_samples
                             or (self.steps[b][a.name] and self.estimate(b, a.name) < self.far * off)
                             for a in self._active(b) if a.method != "off") and self.ledger_seconds(b) < 0
        if self.closed[b]:  # it probes again once plain decoding there took 1 / probe times what SD lost
            self.probe_misses[b] += self.probing[b]  # (times 2 for each probe in a row that found nothing)
            self.repeat_missed[b] |= self.probing[b] and self.probe_repeating[b]
            self.probing[b] = False
            self.probe_after[b] = -self.ledger_seconds(b) / self.probe if self.probe else math.inf
            if not self.retired[b] and self.drafter_since_open[b]:
                self._retire_if_lost(b)  # and the drafter's arms, where they lost, on their own probe

    def _probed_methods(self, b: int) -> tuple[str, ...]:
        """The methods a probe of closed bucket b tries afresh: where its drafter's arms are retired and it has other
        SD arms, those others (the drafter's wait for their own probe), else every SD arm."""
        if self.retired[b] and any(a.method in MODEL_FREE_METHODS for a in self.arms[b]):
            return MODEL_FREE_METHODS
        return SD_METHODS

    def _update_retired(self, b: int) -> None:
        """Retire an open bucket b's learned-drafter arms where they did not pay (while its other arms go on: an
        n-gram arm in looping tails), on `_retire_if_lost`'s rule. Retired arms are neither chosen nor explored and,
        where every bucket's are, no step keeps hidden states (`capturing`), so the drafter's data, rounds and
        publishes stop too (tlt.drafter_train.online). They come back, their windows emptied, with a published
        drafter whose gain could pay (`forget`) and by their own probe: once the bucket decoded 1 / `probe` times the
        seconds they lost there (at least SHADOW steps); a probe of the closed bucket reopens only its other arms
        (docs/design.md §6)."""
        if self.close and not self.retired[b] and not self.closed[b] and self.drafter_since_open[b]:
            self._retire_if_lost(b)

    def _retire_if_lost(self, b: int) -> None:
        """Retire bucket b's learned-drafter arms if every one has `min_samples` steps or is dominated
        (`_dominated`: rarely explored), none beats "off" by min_gain, and their steps together were slower than
        plain decoding of their tokens."""
        off = self.off[b]
        drafters = [a for a in self.arms[b] if a.method in DRAFTER_METHODS]
        if off is None or not drafters:
            return
        best = self._best(b)
        if not all(len(self.steps[b][a.name]) >= self.min_samples or self._dominated(b, a.name, best)
                   for a in drafters):
            return  # not enough evidence yet
        if max(self.estimate(b, a.name) for a in drafters) >= (1 + self.min_gain) * self.estimate(b, off.name):
            return  # one of them pays
        lost = sum(self.steps[b][a.name].seconds - self.steps[b][a.name].plain for a in drafters)
        if lost > 0:
            self.retired[b] = True
            self.retired_misses[b] += self.retired_probing[b]
            self.retired_probing[b] = False
            self.retired_steps[b], self.retired_s[b] = 0, 0.0
            self.retired_probe_after[b] = lost / self.probe if self.probe else math.inf

    def shadowing(self, batch_size: int) -> bool:
        """Whether a plain step at this batch size should ask the n-gram drafter for a row's next token (`shadow`):
        its bucket is closed, probes, and has an n-gram arm."""
        b = self.bucket(batch_size)
        return self.closed[b] and self.probe > 0 and self._ngram_arm[b] is not None

    def watching(self, batch_size: int) -> bool:
        """Whether a plain step at this batch size, with no request waiting, should ask the n-gram drafter for rows'
        next tokens (`loop_shadow`): its bucket is open and has an n-gram arm, and `follow` is on."""
        b = self.bucket(batch_size)
        return bool(self.follow) and not self.closed[b] and self._ngram_arm[b] is not None

    def loop_shadow(self, row: int, hit: bool) -> None:
        """Record whether the n-gram drafter, asked before a plain step with no request waiting (of an open bucket;
        a closed one's answers come through `shadow`), proposed the token the row then drew; `follow` hits in a row
        and the row loops."""
        if hit:
            self.streak[row] = self.streak.get(row, 0) + 1
        else:
            self.streak.pop(row, None)

    def loop_drafted(self, gains: dict[int, int]) -> None:
        """Record the tokens an n-gram step gave each row (row key -> tokens): a row that gained no drafted token
        (one token or none) does not loop, and starts its count again. Only guesses start a loop (`loop_shadow`)."""
        for row, gained in gains.items():
            if gained < 2:
                self.streak.pop(row, None)

    def loop_end(self, rows: Sequence[int]) -> None:
        """The rows finished."""
        for row in rows:
            self.streak.pop(row, None)

    def shadow(self, batch_size: int, hit: bool, row: int | None = None) -> None:
        """Record whether the n-gram drafter, asked before a plain step in a closed bucket, proposed the token `row`
        then drew (a row without a proposal is a miss). With `follow` on the row's hits in a row count as in an
        open bucket (`loop_shadow`): a row that loops is followed (`select`) and brings the probe to its floor
        (`_probe_wait`)."""
        b = self.bucket(batch_size)
        if self.closed[b]:
            self.shadow_hits[b].append(bool(hit))
            if row is not None and self.follow:
                self.loop_shadow(row, hit)

    def shadow_rate(self, b: int) -> float:
        """Share of hits over the bucket's last SHADOW shadow steps; 0 before it has that many."""
        hits = self.shadow_hits[b]
        return sum(hits) / len(hits) if len(hits) == hits.maxlen else 0.0

    def capturing(self, batch_size: int) -> bool:
        """Whether steps at this batch size should keep hidden states for the drafter: where its bucket's
        learned-drafter arms may run (the bucket open, they not retired); in a bucket without such arms, while a
        bucket's may run (its drafts read these states as context). The n-gram arms read none."""
        b = self.bucket(batch_size)
        return self._drafting(b) if self._has_drafter[b] else self.any_open()

    def any_open(self) -> bool:
        """Whether a bucket's learned-drafter arms may run (the bucket open, the arms not retired)."""
        return any(self._drafting(b) for b in range(len(self.arms)))

    def _drafting(self, b: int) -> bool:
        return self._has_drafter[b] and not self.closed[b] and not self.retired[b]

    def forget(self, methods: Sequence[str] = DRAFTER_METHODS, keep: int | None = None,
               gain: float | None = None) -> None:
        """The drafter of these methods' arms changed: keep only their last `keep` steps (default `min_samples`;
        0 wipes them, and they are tried again first), and restart the exploration decay. gain: the new drafter's
        accept length over the old one's, less 1, where known; a closed bucket then reopens (a bucket's retired
        drafter arms return) only if one of these arms, as much faster as the drafters published since it closed
        (they retired) made them together, could beat "off" there (`could_pay`); None reopens every bucket."""
        keep = self.min_samples if keep is None else keep
        for b in range(len(self.arms)):
            retired = self.retired[b] and any(m in DRAFTER_METHODS for m in methods)
            if (self.closed[b] or retired) and gain is not None:
                # the growth published since the bucket closed, and since its drafter arms retired
                closed_grown = self.closed_gain[b] * max(1 + gain, 0.0)
                retired_grown = self.retired_gain[b] * max(1 + gain, 0.0)
                if not self.could_pay(b, methods, (retired_grown if retired else closed_grown) - 1):
                    # stays closed (plain decoding) or retired; no capture there; the windows as they were
                    self.closed_gain[b] = closed_grown if self.closed[b] else 1.0
                    self.retired_gain[b] = retired_grown if self.retired[b] else 1.0
                    continue
            # retired arms come back to a fresh trial: their windows hold the weights they retired on
            self._reopen(b, methods, 0 if retired else keep)

    def new_batch(self) -> None:
        """A new batch of requests (the next rollout): the model-free arms' windows keep their last `min_samples`
        steps, since what they are worth depends on the text (module doc)."""
        for b, bucket in enumerate(self.arms):
            for a in bucket:
                if a.method in MODEL_FREE_METHODS:
                    self.steps[b][a.name].keep_last(self.min_samples, self._prices[b])

    def _probe_wait(self, b: int) -> float:
        """The plain seconds closed bucket b decodes before it probes: `probe_after`, times max(1 - h, 1/8) at the
        n-gram shadow's hit rate h (1/8 while a row loops: one looping row is enough for n-gram drafts to pay,
        however few of the rows hit), and times 2 for each probe in a row that found nothing (up to 2 ** backoff),
        unless the text repeats (`_repeating`) and no probe that began where it repeated was among those: repetition
        is news a probe has not seen, until one has (past EOS, where rows repeat a few tokens, probes at the floor
        came every few seconds, each losing what the last did; docs/design.md §6)."""
        share = SHADOW_FLOOR if self._loops() else max(1.0 - self.shadow_rate(b), SHADOW_FLOOR)
        news = self._repeating(b) and not self.repeat_missed[b]
        return self.probe_after[b] * share * self._backed_off(0 if news else self.probe_misses[b])

    def _repeating(self, b: int) -> bool:
        """Whether the text repeats where closed bucket b decodes: a row loops, or the n-gram shadow guesses half
        or more of the rows asked."""
        return self._loops() or self.shadow_rate(b) >= 0.5

    def _loops(self) -> bool:
        """Whether a running row loops: its last `follow` n-gram guesses held."""
        return bool(self.follow) and any(n >= self.follow for n in self.streak.values())

    def _backed_off(self, misses: int) -> int:
        """The factor on a probe's wait after `misses` probes in a row that found nothing: 2 ** misses, up to
        2 ** backoff."""
        return 2 ** min(misses, self.backoff)

    def _reopen(self, b: int, methods: Sequence[str], keep: int, probe: bool = False) -> None:
        """Open bucket b (if closed) with an empty ledger and exploration restarted, these methods' arms cut to their
        last `keep` steps. probe: opened by its own probe (judged when it closes again or an SD arm with min_samples
        steps pays, `_update_closed`), not for a new drafter, which starts the back-off of a closed bucket (retired
        arms) again; a publish that reaches an open bucket leaves its back-off alone."""
        self.since_forget[b] = 0
        if self.closed[b]:  # a probe of its own arms, or a new drafter (which starts the back-off again)
            self.probing[b] = probe and tuple(methods) == self._probed_methods(b)
            if not probe:
                self.probe_misses[b], self.repeat_missed[b] = 0, False
        self.closed[b], self.closed_gain[b] = False, 1.0  # the new drafter gets its chance; the ledger restarts
        self.closed_steps[b], self.closed_plain_s[b], self.probe_after[b] = 0, 0.0, math.inf
        self.shadow_hits[b].clear()
        self.sd_since_open[b] = 0
        if any(m in DRAFTER_METHODS for m in methods):
            if self.retired[b]:  # their own probe, or a new drafter (which starts their back-off again)
                self.retired_probing[b] = probe
                if not probe:
                    self.retired_misses[b] = 0
            self.retired[b], self.retired_gain[b], self.drafter_since_open[b] = False, 1.0, 0
            self.retired_steps[b], self.retired_s[b], self.retired_probe_after[b] = 0, 0.0, math.inf
        self.ledger[b].keep_last(0, self._prices[b])
        for a in self.arms[b]:
            if a.method in methods:
                self.steps[b][a.name].keep_last(keep, self._prices[b])

    def could_pay(self, b: int, methods: Sequence[str], gain: float) -> bool:
        """Whether an arm of these methods in bucket b, emitting (1 + gain) times the tokens it did for the same
        seconds, would beat "off" there by min_gain; True where one has no steps yet or the bucket has no "off"."""
        off = self.off[b]
        arms = [a for a in self.arms[b] if a.method in methods]
        if off is None or not self.steps[b][off.name] or any(not self.steps[b][a.name] for a in arms):
            return True
        best = max((self.estimate(b, a.name) for a in arms), default=-math.inf)
        return best * max(1 + gain, 0.0) >= (1 + self.min_gain) * self.estimate(b, off.name)

    def plain_seconds(self, batch_size: int, tokens: float, critical: float | None = None) -> float | None:
        """What plain decoding would take for a step's tokens at `batch_size` (critical as in `update`), from the
        "off" steps measured in its bucket's window; None before any."""
        b = self.bucket(batch_size)
        off = self.off[b]
        if off is None or not self.steps[b][off.name]:
            return None
        return self._prices[b]((batch_size, critical is not None), tokens, critical or 0.0)

    def _price_in(self, b: int):
        """Bucket b's price(key, tokens, critical): plain decoding's seconds for tokens emitted at a batch size,
        tokens / bs * t_off(bs) where a request waits; where none does, the critical row's tokens at the fixed part of
        a plain step and the others' at its per-row part (module doc)."""
        costs = self._plain_costs

        def price(key: tuple[int, bool], tokens: float, critical: float) -> float:
            batch_size, by_critical = key
            step, fixed, per_row = costs(b, batch_size)
            if not by_critical:
                return tokens / batch_size * step
            return critical * fixed + (tokens - critical) * per_row
        return price

    def _plain_costs(self, b: int, batch_size: int) -> tuple[float, float, float]:
        """(t_off(bs), fixed, per row): plain decoding's step time at this batch size, over "off"'s window in its
        bucket (at the nearest batch size it ran at there; 1.0 where none: estimates are then tokens a row per
        second), split as fixed + (bs - 1) * per row, fixed = min(t_off(1), t_off(bs)). Without an "off" step at the
        batch size of one in its window, fixed = per row = t_off(bs) / bs (cost proportional to the batch)."""
        table = self._costs[b]
        if batch_size not in table:
            step = self._plain_step_s(batch_size)
            one = self._plain_step_s(1, exact=True) if batch_size > 1 else step
            if step is None:
                costs = (1.0, 1.0 / batch_size, 1.0 / batch_size)
            elif one is None:
                costs = (step, step / batch_size, step / batch_size)
            else:
                fixed = min(one, step)
                costs = (step, fixed, (step - fixed) / (batch_size - 1) if batch_size > 1 else 0.0)
            table[batch_size] = costs
        return table[batch_size]

    def _plain_step_s(self, batch_size: int, exact: bool = False) -> float | None:
        """A plain step's time at this batch size: the lower median of the last PRICE_STEPS "off" steps at it in its
        bucket's window, else (unless exact) at the nearest batch size there; None without one. Not the mean: one
        cold or contended step (a process's first, another process starting) can take 100 times a plain step, and
        where SD is chosen "off" runs seldom, so a mean kept it in the price for the whole window."""
        b = self.bucket(batch_size)
        off = self.off[b]
        window = self.steps[b][off.name] if off is not None else None
        sums = window.by_key if window is not None else {}
        if not _steps_at(window, batch_size):  # not at this batch size
            if exact or not sums:
                return None
            batch_size = min((bs for bs, _ in sums), key=lambda k: (abs(k - batch_size), k))
        recent = []
        for key, _, _, seconds in reversed(window.entries):
            if key[0] == batch_size:
                recent.append(seconds)
                if len(recent) == PRICE_STEPS:
                    break
        return sorted(recent)[(len(recent) - 1) // 2]

    def estimate(self, b: int, name: str) -> float:
        """Speed of the arm over its window relative to plain decoding at the same batch sizes: plain decoding's
        seconds for the tokens it emitted (at the bucket's current prices) / its seconds (see the module doc); -inf
        before its first step."""
        steps = self.steps[b][name]
        if not steps:
            return -math.inf
        if self.off[b] is not None and name == self.off[b].name:
            # its steps' plain seconds over their price: its tokens a row a step, 1.0; its slow steps do not flatter SD
            return steps.plain / max(self._off_price_sum(b), 1e-9)
        return steps.plain / max(steps.seconds, 1e-9)

    def _off_price_sum(self, b: int) -> float:
        """The price of "off"'s steps in bucket b's window, each at its batch size's plain step price (cached until
        they or the prices change)."""
        if self._off_prices[b] is None:
            by_key = self.steps[b][self.off[b].name].by_key
            self._off_prices[b] = sum(n * self._plain_costs(b, bs)[0] for (bs, _), (n, *_) in by_key.items())
        return self._off_prices[b]

    def _best(self, b: int) -> Arm:
        arms = self._active(b)
        top = max(arms, key=lambda a: self.estimate(b, a.name))
        off = self.off[b]
        if (off is not None and top is not off
                and self.estimate(b, top.name) < (1 + self.min_gain) * self.estimate(b, off.name)):
            return off
        return top

    def _dominated(self, b: int, name: str, best: Arm) -> bool:
        n, est, top = len(self.steps[b][name]), self.estimate(b, name), self.estimate(b, best.name)
        return (n >= self.min_samples and est < (1 - self.margin) * top) or (n >= 1 and est < self.far * top)

    def best(self, batch_size: int) -> Arm:
        """The current greedy choice of the bucket (no exploration, no counting)."""
        return self._best(self.bucket(batch_size))

    def bucket_name(self, b: int) -> str:
        lo = 1 if b == 0 else int(self.bounds[b - 1]) + 1
        hi = self.bounds[b]
        return f"bs>={lo}" if hi == math.inf else (f"bs{lo}" if lo == hi else f"bs{lo}-{int(hi)}")

    def closed_buckets(self) -> list[str]:
        return [self.bucket_name(b) for b, c in enumerate(self.closed) if c]

    def retired_buckets(self) -> list[str]:
        """The open buckets whose learned-drafter arms are retired (`_update_retired`)."""
        return [self.bucket_name(b) for b in range(len(self.arms)) if self.retired[b] and not self.closed[b]]

    def stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """{bucket: {arm: {"count", "speed_vs_off"}}} for logging."""
        return {self.bucket_name(b): {a.name: {"count": self.counts[b][a.name],
                                               "speed_vs_off": self.estimate(b, a.name)} for a in arms}
                for b, arms in enumerate(self.arms)}

"""SpecDecoder: adaptive, lossless speculative decoding inside the engine's decode step.

Per decode step, with the running rows in slots 0..B-1:
  gate   SD runs only once the running batch has stayed <= bs_threshold for `hysteresis_steps` steps;
  arm    the bandit picks (method, depth, topk, num_draft_tokens) for the batch-size bucket, or "off";
  draft  EAGLE: catch the drafter cache up on the target hidden states kept since its last step (no re-prefill),
         then grow a chain or an EAGLE-2 tree; n-gram: suffix matches over the prompt, siblings and history;
  verify one target forward over the tree (tree attention mask), exact acceptance (tlt.speculative.verify), the
         accepted nodes' K/V moved into place, the target's logprob of every emitted token.
Acceptance "invariant" (default): deterministic drafts, the target's own draw accepted when a draft holds it, so a
seeded request samples the same tokens with SD on or off. "rejection": chain arms draw their drafts from the
drafter's law at the row's temperature and verify by rejection sampling (the same law, other samples; acceptance
1 - TV(p, q) instead of p(draft)); tree and n-gram arms keep the invariant rule.
Exactness does not depend on the drafter, so its weights can be replaced at any time (`load_drafter_state`).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from tlt.device import host_tensor
from tlt.engine.kv_cache import KVCache
from tlt.engine.sampler import HostRows, transform_logits
from tlt.engine.sequence import Sequence
from tlt.speculative.bandit import DRAFTER_METHODS, Arm, StrategyBandit
from tlt.schema import ConfigError
from tlt.speculative.config import SpecConfig
from tlt.speculative.drafter import Drafter
from tlt.speculative.ngram import NgramDrafter
from tlt.speculative.draft_graph import DraftShape, DraftStep, GraphedDrafter
from tlt.speculative.tree_draft import draft_chain_sampled, draft_tree, draw_uniforms
from tlt.speculative.verify import (chain_to_tree, emitted_logprobs, tree_layout, uniforms_from, verify_deterministic,
                             verify_stochastic)
from tlt.speculative.verify_static import GraphedAcceptance, WalkShape, can_reserve, read, reserve

LOOP_ASKS = 4  # rows a plain step asks the n-gram drafter about (_ask_ngram): a loop at bs 20 shows
#                within 20 steps of `follow_loops` = 4


class SpecDecoder:
    def __init__(self, engine, cfg: SpecConfig, drafter: Drafter | None = None, verify_fn=verify_deterministic,
                 stochastic_verify_fn=verify_stochastic):
        self.engine, self.cfg = engine, cfg
        self.verify_fn = verify_fn  # injectable so tests can show a wrong acceptance rule is caught
        self.stochastic_verify_fn = stochastic_verify_fn  # acceptance="rejection": sampled chains
        self.model = engine.model
        self.drafter = drafter.attach(self.model).to(engine.device, engine.dtype).eval() if drafter else None
        self.ngram = NgramDrafter(max_n=cfg.ngram_max_n, min_n=cfg.ngram_min_n)
        bounds, arms = cfg.arm_table(has_drafter=drafter is not None, device_type=engine.device.type)
        self.bandit = StrategyBandit(bounds, arms, epsilon=cfg.epsilon, window=cfg.window, seed=cfg.seed,
                                     close=cfg.close_buckets, probe=cfg.probe_closed, backoff=cfg.probe_backoff,
                                     follow=cfg.follow(engine.device.type))
        self.dcache = KVCache(self.model.cfg, engine.num_slots, engine.dtype, engine.device, num_layers=1) \
            if drafter else None
        # the drafter's per-depth forwards through CUDA graphs where the engine graphs its own (docs/design.md §9)
        pool = engine.graph_pool
        self.draft_graphs = GraphedDrafter(self.drafter, self.dcache, capture=engine.device.type == "cuda",
                                           pool=pool) if drafter is not None and pool is not None else None
        # logits, probabilities and the acceptance walk in graphs too, read once a step (tlt.speculative.verify_static)
        self.accept_graphs = GraphedAcceptance(self.model, engine.num_slots, capture=engine.device.type == "cuda",
                                               pool=pool) if pool is not None else None
        self.hist: dict[int, torch.Tensor] = {}   # seq_id -> [max_total_len, H] target hidden h_t per position
        self.dcached: dict[int, int] = {}         # seq_id -> committed drafter-cache entries (positions 1..n)
        # the eager catch-up's longest pass: a row's padding then stays within the headroom its caches reserve
        self.catch_up_chunk = cfg.max_draft_len()
        self.low_steps = 0
        self._speculating = False  # inside an SD step, whose measured time already includes its capture
        self._ask_turn = 0         # the last row a plain step asked the n-gram drafter about (_ask_ngram)
        self.drafter_version = 0
        self.reset_stats()
        engine.attach_speculator(self, slot_caches=(self.dcache,) if self.dcache is not None else (),
                                 headroom=cfg.cache_headroom())

    @classmethod
    def from_config(cls, engine, config: dict) -> "SpecDecoder":
        cfg = config if isinstance(config, SpecConfig) else SpecConfig.from_dict(config)
        drafter = None
        if cfg.method == "eagle":
            if not cfg.model:
                raise ConfigError("speculative_config method='eagle' needs model=<drafter dir> (build one with "
                                  "`tlt train-drafter`), or use method='ngram'")
            from tlt.speculative.drafter_io import load_drafter
            drafter = load_drafter(cfg.model)
        return cls(engine, cfg, drafter)

    # ---- stats ----------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.st = {"verify_steps": 0, "emitted": 0, "plain_steps": 0, "gate_steps": 0, "spec_on_steps": 0,
                   "accept_by_bucket": defaultdict(lambda: [0, 0]), "accept_by_pos": defaultdict(lambda: [0, 0]),
                   "arm_counts": defaultdict(int), "draft_time_s": 0.0, "verify_time_s": 0.0,
                   "catchup_time_s": 0.0, "hist_time_s": 0.0, "sd_step_time_s": 0.0, "plain_equiv_s": 0.0,
                   "drafter_step_time_s": 0.0, "drafter_plain_equiv_s": 0.0,
                   "bulk_time_s": 0.0, "tail_time_s": 0.0}
        self._probes_at_reset, self._loop_steps_at_reset = self.bandit.probes, self.bandit.loop_steps
        self._gate_on = False

    def stats(self) -> dict:
        s = self.st
        total = s["gate_steps"] + s["plain_steps"]
        return {
            # NaN, not 0, when nothing was verified (logged as null): an accept length is always >= 1
            "spec_accept_length": s["emitted"] / s["verify_steps"] if s["verify_steps"] else float("nan"),
            # decode steps that drafted and verified; the gate may be open while the bandit picks plain decoding
            "spec_on_fraction": s["spec_on_steps"] / max(total, 1),
            "spec_gate_open_fraction": s["gate_steps"] / max(total, 1),
            "spec_accept_length_by_bucket": {b: e / max(n, 1) for b, (e, n) in sorted(s["accept_by_bucket"].items())},
            "spec_accept_rate_by_position": {d: a / max(n, 1) for d, (a, n) in sorted(s["accept_by_pos"].items())},
            "spec_arm_counts": dict(s["arm_counts"]),
            "spec_draft_time_s": s["draft_time_s"], "spec_verify_time_s": s["verify_time_s"],
            # what the machinery costs (docs/design.md §6): the drafter catching up on plainly decoded positions
            # (part of draft time), keeping the target's hidden states for it, and the net time SD steps saved
            # against plain decoding of the same tokens at the same batch sizes (negative: SD cost time)
            "spec_catchup_time_s": s["catchup_time_s"], "spec_hidden_keep_time_s": s["hist_time_s"],
            "spec_step_time_s": s["sd_step_time_s"], "spec_net_saved_s": s["plain_equiv_s"] - s["sd_step_time_s"],
            # the same for the learned drafter's steps alone (what online drafter training can earn: the n-gram
            # arms' steps need no drafter)
            "spec_drafter_step_time_s": s["drafter_step_time_s"],
            "spec_drafter_net_saved_s": s["drafter_plain_equiv_s"] - s["drafter_step_time_s"],
            "decode_time_bulk_s": s["bulk_time_s"], "decode_time_tail_s": s["tail_time_s"],
            # buckets where SD did not pay: plain decoding without exploration or capture until a probe or a new
            # drafter
            "spec_closed_buckets": len(self.bandit.closed_buckets()),
            # open buckets whose learned-drafter arms did not pay (retired): n-gram and plain decoding only there
            "spec_drafter_retired_buckets": len(self.bandit.retired_buckets()),
            # probes since the stats were reset (probe_closed): closed buckets opened again, retired drafter arms
            # tried again
            "spec_probes": self.bandit.probes - self._probes_at_reset,
            # n-gram steps run because a row of the batch looped (follow_loops)
            "spec_loop_steps": self.bandit.loop_steps - self._loop_steps_at_reset,
        }

    def record_decode_time(self, seconds: float) -> None:
        """Split decode time into the bulk (batch above the threshold, SD off) and the tail (SD gate on)."""
        self.st["tail_time_s" if self._gate_on else "bulk_time_s"] += seconds

    @property
    def num_graph_captures(self) -> int:
        """The drafter's and the acceptance walk's CUDA graphs captured so far (the engine adds them to its own)."""
        return sum(g.num_captured for g in (self.draft_graphs, self.accept_graphs) if g is not None)

    def disable_graphs(self) -> None:
        """Run the speculator's part of each step eagerly, the engine's own graphs kept (benchmarks compare)."""
        self.release_graphs()
        self.draft_graphs = self.accept_graphs = None

    def release_graphs(self) -> None:
        """Drop the speculator's graphs (the engine's sleep frees the drafter cache they point into, and the pool)."""
        for g in (self.draft_graphs, self.accept_graphs):
            if g is not None:
                g.release()

    # ---- engine hooks ---------------------------------------------------------------------------------------
    def on_add(self, seq: Sequence) -> None:
        self.ngram.register(seq.seq_id, seq.group_id, tuple(seq.prompt_ids), seq.prompt_ids)

    def on_new_batch(self) -> None:
        """Requests arrived at an idle engine (the next rollout): the n-gram arms' records are mostly of other text."""
        self.bandit.new_batch()

    def on_prefill(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        if self.drafter is None:
            return
        t0 = time.perf_counter()
        for i, s in enumerate(seqs):
            # zeros: positions decoded while their bucket was closed keep no state, and the drafter reads zeros there
            h = torch.zeros(s.max_total_len + self.cfg.cache_headroom(), hidden.shape[-1], dtype=hidden.dtype,
                            device=hidden.device)
            h[:len(s.prompt_ids)] = hidden[i, :len(s.prompt_ids)]
            self.hist[s.seq_id], self.dcached[s.seq_id] = h, 0
        self.st["hist_time_s"] += time.perf_counter() - t0

    def on_plain_decode(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        # keep h_t so that turning SD on costs only a drafter extend; not in a closed bucket (docs/design.md §6)
        if self.drafter is not None and self.capturing(len(seqs)):
            t0 = time.perf_counter()
            # one multi-tensor copy, not a launch a row
            torch._foreach_copy_([self.hist[s.seq_id][s.num_cached - 1] for s in seqs], list(hidden.unbind(0)))
            dt = time.perf_counter() - t0
            self.st["hist_time_s"] += dt
            self.charge_capture(len(seqs), dt)

    def capturing(self, batch_size: int) -> bool:
        """Whether a step at this batch size keeps hidden states, for drafting and for the requests that ask for
        them (drafter data): not where the bandit closed the bucket because SD did not pay there. Above
        bs_threshold, where SD never runs, while any bucket is open: those states are the context the tail's
        drafts read and the drafter's data."""
        if self._above_gate(batch_size):
            return self.bandit.any_open()
        return self.bandit.capturing(batch_size)

    def charge_capture(self, batch_size: int, seconds: float) -> None:
        """Capture time of a plain step, booked against SD in its bucket (an SD step's own time includes it; above
        bs_threshold no bucket's SD steps run, so no bucket is charged)."""
        if not self._speculating and not self._above_gate(batch_size):
            self.bandit.charge(batch_size, seconds)

    def _above_gate(self, batch_size: int) -> bool:
        return self.cfg.bs_threshold is not None and batch_size > self.cfg.bs_threshold

    def on_finish(self, done: list[Sequence]) -> None:
        self.bandit.loop_end([s.seq_id for s in done])
        for s in done:
            self.ngram.finish(s.seq_id)
            self.hist.pop(s.seq_id, None)
            self.dcached.pop(s.seq_id, None)

    def on_tokens(self, seq: Sequence, new_tokens: list[int]) -> None:
        self.ngram.update(seq.seq_id, new_tokens)

    def wants_step(self, seqs: list[Sequence]) -> bool:
        if self.cfg.bs_threshold is None:
            self._gate_on = True
            return True
        self.low_steps = self.low_steps + 1 if len(seqs) <= self.cfg.bs_threshold else 0
        self._gate_on = self.low_steps >= self.cfg.hysteresis_steps
        if not self._gate_on:
            self.st["plain_steps"] += 1
        return self._gate_on

    def load_drafter_state(self, state: dict[str, torch.Tensor], gain: float | None = None) -> None:
        """Publish new drafter weights into this engine, also mid-rollout (exactness never depends on them). gain:
        their accept length over the old weights', less 1, where measured: the bandit reopens only the closed
        buckets where that could pay (StrategyBandit.forget)."""
        self.drafter.load_state_dict(state, strict=False)
        self.drafter_version += 1
        self.bandit.forget(gain=gain)  # the learned-drafter arms' rewards describe the old weights: a short prior now
        for k in self.dcached:  # the drafter cache was computed by the old weights: rebuild it on next use
            self.dcached[k] = 0

    # ---- one speculative step -------------------------------------------------------------------------------
    def step(self, seqs: list[Sequence]) -> list[Sequence]:
        t0 = time.perf_counter()
        captures, indexing = self.engine.num_graph_captures, self.ngram.index_time_s
        waiting = self.engine.requests_waiting
        # where none waits, the rows may follow a loop (StrategyBandit.select); none loop most of the time
        rows = None if waiting or not self.bandit.streak else [s.seq_id for s in seqs]
        arm = self.bandit.select(len(seqs), rows, rows and [s.max_total_len - s.num_tokens for s in seqs])
        followed = self.bandit.following is not None  # run because a row loops: the bandit does not record it
        # an SD step's worth with no request waiting: how much nearer it brings the batch's end (a plain step's: 1);
        # a step run because a row loops too, in the rollout's accounting (docs/design.md §6: valued by the looping
        # rows instead, such steps looked paid where they lost time on an AVX2 CPU)
        critical = None if arm.method == "off" or waiting else _rows_left(seqs)
        # an n-gram step tells whether the rows that loop still do (also where a request waits)
        before = [len(s.output_ids) for s in seqs] if arm.method == "ngram" and self.bandit.streak else None
        bucket = self.bandit.bucket_name(self.bandit.bucket(len(seqs)))
        self.st["arm_counts"][f"{bucket}:{arm.name}"] += 1
        self.st["gate_steps"] += 1
        self.st["spec_on_steps"] += arm.method != "off"
        if arm.method == "off":
            asked = self._ask_ngram(seqs, waiting)
            logits, hidden = self.engine.decode_forward(seqs)
            self.on_plain_decode(seqs, hidden)
            done = self.engine.sample_and_append(seqs, logits, hidden)
            emitted = len(seqs)
            if asked is not None:
                loop, guesses = asked
                for row, guess in guesses:
                    hit = guess[:1] == seqs[row].output_ids[-1:]
                    if loop:
                        self.bandit.loop_shadow(seqs[row].seq_id, hit)
                    else:
                        self.bandit.shadow(len(seqs), hit, seqs[row].seq_id)
        else:
            only = self.bandit.following  # a step run for the looping rows drafts for them alone
            self._speculating = True
            try:
                done, emitted = self._speculate(seqs, arm, bucket, only)
            finally:
                self._speculating = False
            if before is not None:  # which rows' loops the step's drafts kept (a row it drafted nothing for: no news)
                self.bandit.loop_drafted({s.seq_id: len(s.output_ids) - b for s, b in zip(seqs, before)
                                          if only is None or s.seq_id in only})
        # a step that captured a CUDA graph (~10-100 plain steps, once) says nothing of the arm; nor does the n-gram
        # index's catch-up on the tokens its pools gained since an n-gram step last read them (all of them, prompts
        # included, at a sequence's first)
        seconds = time.perf_counter() - t0 - (self.ngram.index_time_s - indexing)
        if critical is not None:  # how many tokens nearer the batch's furthest end the step came
            critical = _end_gain(seqs, critical)
        if self.engine.num_graph_captures == captures:
            if arm.method != "off" and (plain := self.bandit.plain_seconds(len(seqs), emitted, critical)) is not None:
                self.st["sd_step_time_s"] += seconds
                self.st["plain_equiv_s"] += plain
                if arm.method in DRAFTER_METHODS:
                    self.st["drafter_step_time_s"] += seconds
                    self.st["drafter_plain_equiv_s"] += plain
            self.bandit.update(len(seqs), arm, emitted, seconds, critical, followed=followed)
        return done

    def _ask_ngram(self, seqs: list[Sequence], waiting: bool) -> tuple[bool, list[tuple[int, list[int]]]] | None:
        """Before a plain step, ask the n-gram drafter for rows' next tokens (rows in turn): (whether the answers
        watch for loops in an open bucket, [(row, guess)]) or None; waiting: whether a request waits for a slot.
        With no request waiting a step asks about up to LOOP_ASKS rows: a row whose guesses keep holding loops, and
        n-gram drafts pay there whatever the bucket's past says (StrategyBandit.loop_shadow; in a closed bucket
        StrategyBandit.shadow, where a stretch of hits, a repetitive tail, also brings the next probe nearer). A
        closed bucket with a request waiting asks about one row, for its probe alone. A guess costs 20-120 us
        (docs/design.md §6), a plain step on a 2-core CPU 10-30 ms."""
        n = len(seqs)
        if self.bandit.shadowing(n):
            loop, asks = False, 1 if waiting else min(n, LOOP_ASKS)
        elif self.bandit.watching(n) and not waiting:
            loop, asks = True, min(n, LOOP_ASKS)
        else:
            return None
        rows = [(self._ask_turn + i) % n for i in range(1, asks + 1)]
        self._ask_turn = rows[-1]
        return loop, [(i, self.ngram.propose(seqs[i].seq_id, 1)) for i in rows]

    def _speculate(self, seqs: list[Sequence], arm: Arm, bucket: str,
                   only: set[int] | None = None) -> tuple[list[Sequence], int]:
        """One SD step of `arm`; only: the rows (seq_ids) an n-gram step drafts for (a step run for the rows that
        loop, StrategyBandit.following: the step is theirs, and the others' drafts would only add verification),
        None = every row."""
        eng, dev = self.engine, self.engine.device
        t0 = time.perf_counter()
        # host-to-device copies that wait for nothing (host_tensor) throughout the step
        n, roots = host_tensor([[s.num_cached for s in seqs], [s.last_token for s in seqs]], dev)  # n: last token's pos
        temp = host_tensor([s.params.temperature for s in seqs], dev)
        gens = [s.generator for s in seqs]
        nodes = None  # the verify forward's tokens where not all are (n-gram rows with shorter or no drafts)
        if arm.method == "ngram":
            props = [self.ngram.propose(s.seq_id, arm.num_draft_tokens) if only is None or s.seq_id in only else []
                     for s in seqs]
            k = max(1, max(map(len, props)))
            draft = host_tensor([p + [0] * (k - len(p)) for p in props], dev)
            tokens, parents, valid = chain_to_tree(roots, draft, host_tensor([len(p) for p in props], dev))
            q = None
            mask, depths = tree_layout(parents, valid)
            if dev.type == "cpu" and any(len(p) < k for p in props):  # (a GPU's forwards and walk are graphed)
                nodes = valid
        else:
            t_catchup = time.perf_counter()
            root_pred = self._drafter_catch_up(seqs)
            self.st["catchup_time_s"] += time.perf_counter() - t_catchup
            drafted = self._draft(seqs, arm, roots, root_pred, n, temp, gens)
            tokens, parents, q = drafted.tree.tokens, drafted.tree.parents, drafted.tree.q
            mask, depths = drafted.mask, drafted.depths  # a drafted tree has every node valid
            valid = torch.ones_like(tokens, dtype=torch.bool)
        t1 = time.perf_counter()
        hidden = self._verify_forward(seqs, tokens, mask, depths, nodes)
        if self._walks_on_device(gens, q):
            result, lps = self._device_walk(seqs, arm, hidden, q, tokens, parents, valid, gens)
        else:
            logits, p = self._target_logits_probs(seqs, hidden, nodes)
            if q is not None:  # drafts drawn from q: Leviathan/Chen rejection sampling
                result = self.stochastic_verify_fn(p, q, tokens, parents, valid, gens)
            else:
                result = self.verify_fn(p, tokens, parents, valid, gens)
            lps = emitted_logprobs(logits, temp, result)
        kept = self._kept_states(hidden, result.paths)
        self._commit(seqs, result.paths, kept)
        done = eng.append_tokens(seqs, result.emitted_ids, lps, kept)
        self._record(bucket, result, seqs, arm)
        self.st["draft_time_s"] += t1 - t0
        self.st["verify_time_s"] += time.perf_counter() - t1
        return done, sum(len(e) for e in result.emitted_ids)

    def _drafter_catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Extend the drafter cache with (h_{t-1}, x_t) for every position t not in it yet, through each row's
        last token n; return the drafter's predicted hidden state at n [B, H] (the tree root's)."""
        starts = [self.dcached[s.seq_id] + 1 for s in seqs]     # first missing position per row
        ends = [s.num_cached for s in seqs]                      # last token's position n
        T = max(e - st + 1 for st, e in zip(starts, ends))
        graphed = self.draft_graphs.catch_up_length(T) if self.draft_graphs is not None else None
        if graphed:  # a graphed catch-up runs at one of a few padded lengths
            return self._catch_up_pass(seqs, starts, ends, graphed, graphed=True)
        # Eagerly, in passes of at most max_draft_len positions: every row is padded to the pass's length, so one
        # pass over a newly admitted row's whole prompt would write a deep row's padding past the headroom its
        # caches reserve (SpecConfig.cache_headroom), growing the drafter cache (docs/design.md §9).
        chunk = self.catch_up_chunk
        out = None
        while True:
            stops = [min(e, st + chunk - 1) for st, e in zip(starts, ends)]
            T = max(stop - st + 1 for st, stop in zip(starts, stops))
            pred = self._catch_up_pass(seqs, starts, stops, T, graphed=False)
            if out is None:
                out = pred
            else:  # a row's prediction comes from the pass that reached its last position
                ended = host_tensor([st <= e == stop for st, e, stop in zip(starts, ends, stops)], pred.device)
                out = torch.where(ended[:, None], pred, out)
            starts = [stop + 1 for stop in stops]
            if all(st > e for st, e in zip(starts, ends)):
                return out

    def _catch_up_pass(self, seqs: list[Sequence], starts: list[int], ends: list[int], T: int,
                       graphed: bool) -> torch.Tensor:
        """One drafter forward over positions starts..ends of each row (none where start > end), padded to T;
        returns the prediction at each row's last position [B, H] (undefined for a row with none)."""
        dev = self.engine.device
        H = self.model.cfg.hidden_size
        hid = torch.zeros(len(seqs), T, H, dtype=self.engine.dtype, device=dev)
        torch._foreach_copy_([hid[i, :e - st + 1] for i, (st, e) in enumerate(zip(starts, ends))],
                             [self.hist[s.seq_id][st - 1:e] for s, st, e in zip(seqs, starts, ends)])
        # token ids and positions built on the host, one copy each (padding: id 0 at position 0)
        pad = [T - (e - st + 1) for st, e in zip(starts, ends)]
        ids, pos = host_tensor([[s.all_ids()[st:e + 1] + [0] * k for s, st, e, k in zip(seqs, starts, ends, pad)],
                                [list(range(st, e + 1)) + [0] * k for st, e, k in zip(starts, ends, pad)]], dev)
        cached = [st - 1 for st in starts]
        lens, last = host_tensor([cached, [max(e - st, 0) for st, e in zip(starts, ends)]], dev)
        for s, e in zip(seqs, ends):
            self.dcached[s.seq_id] = e
        if graphed:
            return self.draft_graphs.catch_up(hid, ids, pos, lens, last, max(cached))
        # rows are padded to T, so a row writes its padding up to (its cached entries) + T
        self.dcache.ensure_capacity(max(cached) + T)
        with torch.inference_mode():  # static with the graphs: nothing read from the device
            out = self.drafter(hid, ids, pos, self.dcache.view(lens, static=self.draft_graphs is not None))
        return out[torch.arange(len(seqs), device=dev), last]

    def _draft(self, seqs, arm: Arm, roots, root_pred, n, temp, gens) -> DraftStep:
        """The drafter's tree (or chain) for this step and its verify layout: through the drafting graphs where the
        engine graphs its forwards (tlt.speculative.draft_graph), else eagerly (the same code)."""
        max_n = max(s.num_cached for s in seqs)
        sampled = self.cfg.acceptance == "rejection" and arm.method == "eagle_chain"
        # the sampled chain's draws, level by level before drafting: the rows' generators advance as they did when
        # each level drew its own
        uniforms = host_tensor(draw_uniforms(uniforms_from(gens), len(seqs), arm.depth), n.device) \
            if sampled else None
        if self.draft_graphs is not None:
            shape = DraftShape(arm.depth, arm.topk, arm.num_draft_tokens, sampled)
            return self.draft_graphs.draft(shape, roots, root_pred, n, max_n, temp, uniforms)
        self.dcache.ensure_capacity(max_n + arm.depth * arm.topk + 1)
        if sampled:
            tree = draft_chain_sampled(self.drafter, self.dcache, roots, root_pred, n, n, arm.depth, temp, uniforms)
        else:
            tree = draft_tree(self.drafter, self.dcache, roots, root_pred, n, n, arm.depth, arm.topk,
                              arm.num_draft_tokens)
        with torch.inference_mode():
            mask, depths = tree_layout(tree.parents)
        return DraftStep(tree, mask, depths)

    @torch.inference_mode()
    def _verify_forward(self, seqs, tokens, mask, depths, nodes=None) -> torch.Tensor:
        return self.engine.tree_forward(seqs, tokens, depths, mask, nodes)

    def _walks_on_device(self, gens, q) -> bool:
        """The graphed walk stands in for the default rules only (tests inject others), with a generator a row."""
        rule = self.verify_fn if q is None else self.stochastic_verify_fn
        return self.accept_graphs is not None and rule in (verify_deterministic, verify_stochastic) \
            and can_reserve(gens)

    def _device_walk(self, seqs, arm: Arm, hidden, q, tokens, parents, valid, gens):
        """Logits, probabilities and the acceptance walk in one graph, over a fixed number of levels (no path is
        longer than the arm's depth + 1, an n-gram chain's length), its uniforms drawn ahead; one read at the end."""
        N = tokens.shape[1]
        steps = N if arm.method == "ngram" else min(N, arm.depth + 1)
        width = arm.topk if arm.method == "eagle_tree" else 1  # a drafted node has at most topk children
        reserved = reserve(gens, steps if q is None else steps * width + 1, hidden.device)
        temp, top_k, top_p = _sampling_rows(seqs)
        shape = WalkShape(N, steps, width, q is not None, HostRows.of(temp, top_k, top_p, self.model.cfg.vocab_size))
        t, k = host_tensor(temp, hidden.device, torch.float32), host_tensor(top_k, hidden.device)
        walk, lp = self.accept_graphs.walk(shape, hidden, tokens, parents, valid, t, k,
                                           host_tensor(top_p, hidden.device, torch.float32), reserved.u, q)
        return read(walk, lp, reserved)

    def _target_logits_probs(self, seqs, hidden: torch.Tensor,
                             nodes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits and probabilities [B, N, V] at the verify forward's nodes (hidden [B, N, H]); with
        `nodes`, at those only, the rest of both tensors left unwritten (the walk and the log-probs read only nodes
        the walk visits, all among them)."""
        B, N, _ = hidden.shape
        temp, top_k, top_p = _sampling_rows(seqs)
        logits = self.model.logits(hidden.flatten(0, 1) if nodes is None else hidden[nodes])
        per_node = N if nodes is None else nodes.sum(1)
        rows = lambda xs: host_tensor(xs, hidden.device).repeat_interleave(per_node)  # noqa: E731
        V = logits.shape[-1]
        p = transform_logits(logits, rows(temp), rows(top_k), rows(top_p),
                             HostRows.of(temp, top_k, top_p, V))  # nothing read from the device
        if nodes is None:
            return logits.view(B, N, V), p.view(B, N, V)
        all_logits, all_p = logits.new_empty(B, N, V), p.new_empty(B, N, V)
        all_logits[nodes], all_p[nodes] = logits, p
        return all_logits, all_p

    @staticmethod
    def _kept_states(hidden: torch.Tensor, paths: list[list[int]]) -> list[torch.Tensor]:
        """hidden [B, N, H] -> per row its path's states [len(path), H], gathered at once (one index copy)."""
        idx = host_tensor([[i for i, path in enumerate(paths) for _ in path], [n for path in paths for n in path]],
                          hidden.device)
        return list(hidden[idx[0], idx[1]].split([len(path) for path in paths]))

    def _commit(self, seqs, paths, kept) -> None:
        """Keep the accepted nodes' hidden states (drafter data), then move their K/V into place."""
        if self.drafter is not None:
            torch._foreach_copy_([self.hist[s.seq_id][s.num_cached:s.num_cached + len(k)] for s, k in zip(seqs, kept)],
                                 kept)
        self.engine.commit_kv(seqs, paths)

    def _record(self, bucket, result, seqs, arm: Arm) -> None:
        st = self.st
        st["verify_steps"] += len(seqs)
        for path in result.paths:
            st["emitted"] += len(path)
            b = st["accept_by_bucket"][bucket]
            b[0] += len(path); b[1] += 1
            for d in range(1, arm.depth + 1):
                a = st["accept_by_pos"][d]
                a[0] += int(len(path) - 1 >= d); a[1] += 1


def _sampling_rows(seqs: list[Sequence]) -> tuple[list[float], list[int], list[float]]:
    """The rows' temperature, top_k and top_p, as host lists."""
    return ([s.params.temperature for s in seqs], [s.params.top_k for s in seqs], [s.params.top_p for s in seqs])


def _rows_left(seqs: list[Sequence]) -> list[tuple[int, int]]:
    """(tokens left to its limit, output length) per row (max_tokens or the context): with no request waiting the
    batch only shrinks, and a rollout of rows that run to their limit ends with the one furthest from it."""
    return [(s.max_total_len - s.num_tokens, len(s.output_ids)) for s in seqs]


def _end_gain(seqs: list[Sequence], before: list[tuple[int, int]]) -> int:
    """How many tokens nearer a step brought the end of a batch whose rows all run to their limit: the most tokens a
    row had left (`_rows_left` before the step), less the most any row has left after it, counting the tokens each
    gained, also a row that finished (StrategyBandit.update's `critical`). A plain step's is 1. Not what the furthest
    row gained: where it gained 3 and the row one behind it 1, the end came 2 nearer (docs/design.md §6)."""
    most = max(left for left, _ in before)
    return most - max(left - (len(s.output_ids) - n) for s, (left, n) in zip(seqs, before))

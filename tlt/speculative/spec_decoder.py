"""SpecDecoder: adaptive, lossless speculative decoding behind the engine's decode step (docs/design.md §6-§8).

The engine owns the sequences, their hidden-state records, the target's forwards, the K/V commit and the timing;
this is the speculator on the other side of that seam (as vLLM's proposer and rejection sampler):
  choose   the policy (tlt.speculative.policy) picks the step's arm for its batch-size bucket, or "off";
  propose  EAGLE: catch the drafter's cache up on the target hidden states kept since its last step (no re-prefill),
           then grow a chain or an EAGLE-2 tree; n-gram: suffix matches over the prompt, siblings and history;
  verify   after the engine's target forward over the tree: exact acceptance (tlt.speculative.verify) and the
           target's logprob of every emitted token; the engine then commits the accepted nodes;
  observe  the step's tokens and its cost on the engine's clock go to the policy.
Acceptance "invariant" (default): deterministic drafts, the target's own draw accepted when a draft holds it, so a
seeded request samples the same tokens with SD on or off. "rejection": chain arms draw their drafts from the
drafter's law at the row's temperature and verify by rejection sampling (the same law, other samples); tree and
n-gram arms keep the invariant rule. Exactness does not depend on the drafter, so its weights can be replaced at
any time (`load_drafter_state`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from tlt.device import host_tensor
from tlt.engine.kv_cache import KVCache
from tlt.engine.sampler import HostRows, transform_logits
from tlt.engine.sequence import Sequence
from tlt.schema import ConfigError
from tlt.speculative.config import SpecConfig
from tlt.speculative.draft_graph import CATCH_UP_LENGTHS, DrafterRunner, DraftShape, DraftStep
from tlt.speculative.drafter import Drafter
from tlt.speculative.ngram import NgramDrafter
from tlt.speculative.policy import DRAFTER_METHODS, Arm
from tlt.speculative.verify import (GraphedAcceptance, VerifyResult, WalkShape, can_reserve, chain_to_tree,
                                    emitted_logprobs, read, reserve, tree_layout, uniforms, verify_deterministic,
                                    verify_stochastic)


@dataclass
class Draft:
    """A step's proposal: per row a tree of N nodes, node 0 the last accepted token (tlt.speculative.verify)."""
    arm: Arm
    tokens: torch.Tensor                # [B, N]
    parents: torch.Tensor               # [B, N] parent node, -1 for the root
    valid: torch.Tensor                 # [B, N] bool: rows may hold fewer nodes
    mask: torch.Tensor                  # [B, N, N] node attends to node (the verify forward's tree mask)
    depths: torch.Tensor                # [B, N] node depth (position = num_cached + depth)
    q: torch.Tensor | None = None       # [B, N, V] the law sampled drafts were drawn from (rejection sampling)
    nodes: torch.Tensor | None = None   # [B, N] bool: the tokens the verify forward must compute (None: all)
    rank: torch.Tensor | None = None    # [B, N] top-k drafts' places by score, and their argmax chain (DraftTree)
    greedy: torch.Tensor | None = None


class SpecDecoder:
    def __init__(self, engine, cfg: SpecConfig, drafter: Drafter | None = None, verify_fn=verify_deterministic,
                 stochastic_verify_fn=verify_stochastic):
        self.engine, self.cfg = engine, cfg
        self.verify_fn = verify_fn  # injectable so tests can show a wrong acceptance rule is caught
        self.stochastic_verify_fn = stochastic_verify_fn  # acceptance="rejection": sampled chains
        self.model, self.clock = engine.model, engine.clock
        self.drafter = drafter.attach(self.model).to(engine.device, engine.dtype).eval() if drafter else None
        self.ngram = NgramDrafter()
        self.policy = cfg.policy(has_drafter=drafter is not None, device_type=engine.device.type)
        self.dcache = KVCache(self.model.cfg, engine.num_slots, engine.dtype, engine.device, num_layers=1) \
            if drafter else None
        # the drafter's side of a step: through CUDA graphs where the engine graphs its own forwards, else eagerly,
        # the same code (docs/design.md §9)
        pool = engine.graph_pool
        self.draft_graphs = DrafterRunner(self.drafter, self.dcache, static=pool is not None,
                                          capture=engine.device.type == "cuda", pool=pool) if drafter else None
        # logits, probabilities and the acceptance walk in graphs too, read once a step (tlt.speculative.verify)
        self.accept_graphs = GraphedAcceptance(self.model, engine.num_slots, capture=engine.device.type == "cuda",
                                               pool=pool) if pool is not None else None
        self.catch_up_chunk = CATCH_UP_LENGTHS[-1]  # the longest catch-up pass, in positions a row
        self.drafter_version = 0
        self._rebuild = False  # the next drafter step rebuilds the running rows' drafter caches (a publish)
        self._nested: dict[Arm, list[int]] = {}  # the step's nested arms' tokens a row (verify -> observe)
        self._before: list[int] = []             # the rows' output lengths before the step
        self.reset_stats()
        engine.attach_speculator(self, slot_caches=(self.dcache,) if self.dcache is not None else (),
                                 headroom=cfg.cache_headroom(), hidden_records=drafter is not None)

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
        self.st = {"verify_steps": 0, "emitted": 0, "decode_steps": 0, "spec_on_steps": 0,
                   "accept_by_bucket": defaultdict(lambda: [0, 0]), "accept_by_pos": defaultdict(lambda: [0, 0]),
                   "arm_counts": defaultdict(int), "sd_step_time_s": 0.0, "plain_equiv_s": 0.0,
                   "drafter_step_time_s": 0.0, "drafter_plain_equiv_s": 0.0, "bulk_time_s": 0.0, "tail_time_s": 0.0}

    def stats(self) -> dict:
        s = self.st
        return {
            # NaN, not 0, when nothing was verified (logged as null): an accept length is always >= 1
            "spec_accept_length": s["emitted"] / s["verify_steps"] if s["verify_steps"] else float("nan"),
            "spec_on_fraction": s["spec_on_steps"] / max(s["decode_steps"], 1),  # decode steps that drafted
            "spec_accept_length_by_bucket": {b: e / max(n, 1) for b, (e, n) in sorted(s["accept_by_bucket"].items())},
            "spec_accept_rate_by_position": {d: a / max(n, 1) for d, (a, n) in sorted(s["accept_by_pos"].items())},
            "spec_arm_counts": dict(s["arm_counts"]),
            # the SD steps' seconds on the engine's clock and what they saved against plain decoding of the same
            # tokens at the same batch sizes (the policy's prices; negative: SD cost time), and the same for the
            # learned drafter's steps alone (what online drafter training can earn)
            "spec_step_time_s": s["sd_step_time_s"], "spec_net_saved_s": s["plain_equiv_s"] - s["sd_step_time_s"],
            "spec_drafter_step_time_s": s["drafter_step_time_s"],
            "spec_drafter_net_saved_s": s["drafter_plain_equiv_s"] - s["drafter_step_time_s"],
            # decode time above bs_threshold (SD off) and at or below it (the tail)
            "decode_time_bulk_s": s["bulk_time_s"], "decode_time_tail_s": s["tail_time_s"],
            "spec_parked_buckets": len(self.policy.parked_buckets()),  # buckets decoding plainly: no SD arm pays
        }

    @property
    def num_graph_captures(self) -> int:
        """The drafter's and the acceptance walk's CUDA graphs captured so far (the engine adds them to its own)."""
        return sum(g.num_captured for g in (self.draft_graphs, self.accept_graphs) if g is not None)

    def disable_graphs(self) -> None:
        """Run the speculator's part of each step eagerly, the engine's own graphs kept (benchmarks compare)."""
        self.release_graphs()
        self.accept_graphs = None
        if self.drafter is not None:
            self.draft_graphs = DrafterRunner(self.drafter, self.dcache, static=False)

    def release_graphs(self) -> None:
        """Drop the speculator's graphs (the engine's sleep frees the drafter cache they point into, and the pool)."""
        for g in (self.draft_graphs, self.accept_graphs):
            if g is not None:
                g.release()

    # ---- the engine's side of the seam ----------------------------------------------------------------------
    def on_add(self, seq: Sequence) -> None:
        self.ngram.register(seq.seq_id, seq.group_id, tuple(seq.prompt_ids), seq.prompt_ids)

    def on_tokens(self, seq: Sequence, new_tokens: list[int]) -> None:
        self.ngram.update(seq.seq_id, new_tokens)

    def on_finish(self, done: list[Sequence]) -> None:
        for s in done:
            self.ngram.finish(s.seq_id)

    def choose(self, seqs: list[Sequence]) -> Arm:
        return self.policy.choose(len(seqs))

    def observe(self, seqs: list[Sequence], arm: Arm | None, emitted: int, seconds: float, captured: bool) -> None:
        """A decode step of `arm` (None: no speculator's choice) emitted `emitted` tokens in `seconds` (on the
        engine's clock). A step that captured a CUDA graph, or the first drafter step after a publish mid-rollout
        (it rebuilds every row's drafter cache), is not the arm's cost and is not given to the policy."""
        bs, st = len(seqs), self.st
        nested, self._nested = self._nested, {}
        tail = self.cfg.bs_threshold is None or bs <= self.cfg.bs_threshold
        st["tail_time_s" if tail else "bulk_time_s"] += seconds
        st["decode_steps"] += 1
        if arm is None:
            return
        st["arm_counts"][f"{self.policy.bucket(bs).name}:{arm.name}"] += 1
        if arm.method != "off":
            st["spec_on_steps"] += 1
        rebuilt = arm.method in DRAFTER_METHODS and self._rebuild
        self._rebuild = self._rebuild and not rebuilt
        if captured:
            return
        plain = self.policy.plain_seconds(bs, emitted)
        if arm.method != "off" and plain is not None:
            st["sd_step_time_s"] += seconds
            st["plain_equiv_s"] += plain
            if arm.method in DRAFTER_METHODS:
                st["drafter_step_time_s"] += seconds
                st["drafter_plain_equiv_s"] += plain
        if not rebuilt:  # a step that rebuilt every row's drafter cache (after a publish) is not the arm's cost
            kept = [len(s.output_ids) - n for s, n in zip(seqs, self._before)] if nested else []  # before a stop
            self.policy.observe(bs, arm, emitted, seconds,
                                {a: sum(map(min, counts, kept)) for a, counts in nested.items()})

    def load_drafter_state(self, state: dict[str, torch.Tensor], gain: float | None = None) -> None:
        """Publish new drafter weights into this engine, also mid-rollout (exactness never depends on them). gain:
        their accept length over the old weights', less 1, where measured (AdaptivePolicy.drafter_changed)."""
        self.drafter.load_state_dict(state, strict=False)
        self.drafter_version += 1
        self.policy.drafter_changed(gain)
        for s in self.engine.running:  # the drafter cache was computed by the old weights: rebuild it
            s.draft_cached = 0
        self._rebuild = bool(self.engine.running)

    # ---- propose ----------------------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], arm: Arm) -> Draft:
        dev = self.engine.device
        # host-to-device copies that wait for nothing (host_tensor) throughout the step
        n, roots = host_tensor([[s.num_cached for s in seqs], [s.last_token for s in seqs]], dev)  # n: last token's pos
        if arm.method == "ngram":
            props = [self.ngram.propose(s.seq_id, arm.num_draft_tokens) for s in seqs]
            self.clock.forward("ngram", len(seqs), arm.num_draft_tokens, 0)
            k = arm.num_draft_tokens  # every step of the arm one width (one graph), shorter drafts' nodes invalid
            draft = host_tensor([p + [0] * (k - len(p)) for p in props], dev)
            tokens, parents, valid = chain_to_tree(roots, draft, host_tensor([len(p) for p in props], dev))
            mask, depths = tree_layout(parents, valid)
            nodes = valid if dev.type == "cpu" and any(len(p) < k for p in props) else None  # (a GPU's: graphed)
            return Draft(arm, tokens, parents, valid, mask, depths, None, nodes)
        temp = host_tensor([s.params.temperature for s in seqs], dev)
        root_pred = self._drafter_catch_up(seqs)
        drafted = self._draft(seqs, arm, roots, root_pred, n, temp, [s.generator for s in seqs])
        tree = drafted.tree  # a drafted tree has every node valid
        return Draft(arm, tree.tokens, tree.parents, torch.ones_like(tree.tokens, dtype=torch.bool), drafted.mask,
                     drafted.depths, tree.q, rank=tree.rank, greedy=tree.greedy)

    # ---- the drafter's cache and drafts ---------------------------------------------------------------------
    def _drafter_catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Extend the drafter cache with (h_{t-1}, x_t) for every position t not in it yet, through each row's
        last token n; return the drafter's predicted hidden state at n [B, H] (the tree root's). In passes of at
        most catch_up_chunk positions a row: every row is padded to its pass's length, which the headroom the caches
        reserve past a row's end holds (SpecConfig.cache_headroom; docs/design.md §9)."""
        starts = [s.draft_cached + 1 for s in seqs]  # first missing position per row
        ends = [s.num_cached for s in seqs]          # last token's position n
        out = None
        while True:
            stops = [min(e, st + self.catch_up_chunk - 1) for st, e in zip(starts, ends)]
            T = self.draft_graphs.catch_up_length(max(stop - st + 1 for st, stop in zip(starts, stops)))
            pred = self._catch_up_pass(seqs, starts, stops, T)
            if out is None:
                out = pred
            else:  # a row's prediction comes from the pass that reached its last position
                ended = host_tensor([st <= e == stop for st, e, stop in zip(starts, ends, stops)], pred.device)
                out = torch.where(ended[:, None], pred, out)
            starts = [stop + 1 for stop in stops]
            if all(st > e for st, e in zip(starts, ends)):
                return out

    def _catch_up_pass(self, seqs: list[Sequence], starts: list[int], ends: list[int], T: int) -> torch.Tensor:
        """One drafter forward over positions starts..ends of each row (none where start > end), padded to T;
        returns the prediction at each row's last position [B, H] (undefined for a row with none)."""
        dev = self.engine.device
        hid = torch.zeros(len(seqs), T, self.model.cfg.hidden_size, dtype=self.engine.dtype, device=dev)
        torch._foreach_copy_([hid[i, :e - st + 1] for i, (st, e) in enumerate(zip(starts, ends))],
                             [s.hidden_record[st - 1:e] for s, st, e in zip(seqs, starts, ends)])
        # token ids and positions built on the host, one copy each (padding: id 0 at position 0)
        pad = [T - (e - st + 1) for st, e in zip(starts, ends)]
        ids, pos = host_tensor([[s.all_ids()[st:e + 1] + [0] * k for s, st, e, k in zip(seqs, starts, ends, pad)],
                                [list(range(st, e + 1)) + [0] * k for st, e, k in zip(starts, ends, pad)]], dev)
        cached = [st - 1 for st in starts]
        lens, last = host_tensor([cached, [max(e - st, 0) for st, e in zip(starts, ends)]], dev)
        for s, e in zip(seqs, ends):
            s.draft_cached = e
        self.clock.forward("drafter", len(seqs), T, sum(cached))
        self.clock.forward("draft_head", len(seqs), 1, 0)  # the root's prediction: the first level's logits
        return self.draft_graphs.catch_up(hid, ids, pos, lens, last, max(cached))

    def _draft(self, seqs, arm: Arm, roots, root_pred, n, temp, gens) -> DraftStep:
        """The drafter's tree (or chain) for this step and its verify layout (tlt.speculative.draft_graph)."""
        sampled = self.cfg.acceptance == "rejection" and arm.method == "eagle_chain"
        # the sampled chain's draws, level by level before drafting: the rows' generators advance as they did when
        # each level drew its own
        u = uniforms(gens, len(seqs), arm.depth, n.device)[0] if sampled else None  # all of them used
        width = 1 if sampled else arm.topk  # each later level's tokens a row (the root's logits: the catch-up's)
        for level in range(1, arm.depth):
            self.clock.forward("drafter", len(seqs), width, sum(s.draft_cached + level * width for s in seqs))
            self.clock.forward("draft_head", len(seqs), width, 0)
        shape = DraftShape(arm.depth, arm.topk, arm.num_draft_tokens, sampled)
        return self.draft_graphs.draft(shape, roots, root_pred, n, max(s.num_cached for s in seqs), temp, u)

    # ---- verify -------------------------------------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], draft: Draft, hidden: torch.Tensor) -> tuple[VerifyResult, list[list[float]]]:
        """The target's verdict on the draft from the verify forward's hidden states [B, N, H]: the accepted paths
        and emitted tokens, and the target's log-prob of each emitted token."""
        gens = [s.generator for s in seqs]
        if self._walks_on_device(gens, draft.q):
            result, lps = self._device_walk(seqs, draft.arm, hidden, draft.q, draft.tokens, draft.parents,
                                            draft.valid, gens)
        else:
            logits, p = self._target_logits_probs(seqs, hidden, draft.nodes)
            if draft.q is not None:  # drafts drawn from q: Leviathan/Chen rejection sampling
                result = self.stochastic_verify_fn(p, draft.q, draft.tokens, draft.parents, draft.valid, gens)
            else:
                result = self.verify_fn(p, draft.tokens, draft.parents, draft.valid, gens)
            temp = host_tensor([s.params.temperature for s in seqs], hidden.device)
            lps = emitted_logprobs(logits, temp, result)
        self._record(seqs, draft.arm, result)
        self._nested = self._nested_accepts(seqs, draft, result)
        return result, lps

    def _nested_accepts(self, seqs: list[Sequence], draft: Draft, result: VerifyResult) -> dict[Arm, list[int]]:
        """For each arm nested in the step's (AdaptivePolicy.nested): the tokens it would have emitted a row on this
        step (nested_emitted), before the row's stop (observe applies that)."""
        nested = self.policy.nested(len(seqs), draft.arm) if draft.rank is not None else []
        if not nested:
            return {}
        self._before = [len(s.output_ids) for s in seqs]
        rank, greedy = torch.stack([draft.rank, draft.greedy.long()]).tolist()  # one read of the device
        return {arm: nested_emitted(arm, result.paths, rank, greedy) for arm in nested}

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
        return read(walk, reserved.settle, lp)

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

    def _record(self, seqs: list[Sequence], arm: Arm, result: VerifyResult) -> None:
        st = self.st
        bucket = self.policy.bucket(len(seqs)).name
        st["verify_steps"] += len(seqs)
        for path in result.paths:
            st["emitted"] += len(path)
            b = st["accept_by_bucket"][bucket]
            b[0] += len(path); b[1] += 1
            for d in range(1, arm.depth + 1):
                a = st["accept_by_pos"][d]
                a[0] += int(len(path) - 1 >= d); a[1] += 1


def nested_emitted(arm: Arm, paths: list[list[int]], rank: list[list[int]], greedy: list[list[bool]]) -> list[int]:
    """The tokens `arm` would have emitted a row had it drafted on a step whose drafts held its own (nested_in), from
    that step's accepted paths and its drafts' rank and greedy marks (DraftTree): the path's nodes that it drafts
    too, then one token. The same draws decide each level either way: a level's sample is kept where the arm drafted
    it, else it is the arm's own last token. (A lower bound where the drafts lacked some of the arm's nodes: part of
    its chain, or a shallower tree's nodes ranked below the budget among deeper ones.)"""
    out = []
    for path, ranks, marks in zip(paths, rank, greedy):
        m = 0
        for node in path[1:arm.depth + 1]:
            if not (marks[node] if arm.topk == 1 else ranks[node] < arm.num_draft_tokens):
                break
            m += 1
        out.append(m + 1)
    return out


def _sampling_rows(seqs: list[Sequence]) -> tuple[list[float], list[int], list[float]]:
    """The rows' temperature, top_k and top_p, as host lists."""
    return ([s.params.temperature for s in seqs], [s.params.top_k for s in seqs], [s.params.top_p for s in seqs])

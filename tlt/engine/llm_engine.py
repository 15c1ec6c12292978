"""LLMEngine: continuous batching. Each step either prefills newly admitted requests or decodes all running ones.

    engine.add_request(prompt_ids, params) ... while engine.has_unfinished(): finished += engine.step()

A speculative decoder (tlt.speculative) can take over decode steps through the seam below attach_speculator: it
chooses a step's arm, proposes drafts and verifies them; the engine runs the target and commits. It is exact: at temperature 0 it emits the very tokens plain decoding
would; at temperature > 0 every token is an exact draw from the same distribution, and a seeded
request gets the very tokens plain decoding samples (drafter-invariant verification, where the forwards round
alike: the fp32 CPU path); logprobs are the target's in all cases. Its tests check all of these.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from tlt.device import host_tensor
from tlt.engine.clock import WallClock
from tlt.engine.cuda_graph import GraphPool
from tlt.engine.kv_cache import KVCache
from tlt.engine.model_runner import ModelRunner
from tlt.engine.params import SamplingParams
from tlt.engine.sampler import HostRows, greedy, read_sampled, rows_on_device, sample
from tlt.engine.scheduler import Scheduler
from tlt.engine.sequence import Sequence
from tlt.models.decoder import Decoder
from tlt.models.flex import resolve_backend


SMALL_BATCHES = (1, 2, 4, 8)  # EngineStats.decode_time_upto_bs: decode time while at most this many sequences run


@dataclass
class EngineStats:
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_spec_steps: int = 0
    num_generated_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    hidden_copy_time_s: float = 0.0  # host copies of hidden states the requests asked for (drafter data)
    # per running batch size: [decode steps, tokens emitted, seconds] (where a rollout's time goes)
    decode_by_bs: dict[int, list] = field(default_factory=dict)
    # SD steps' seconds by phase: propose (drafting), verify (the target's forward and acceptance), commit (K/V moves,
    # hidden states, appending tokens), on the engine's clock
    spec_phase_time_s: dict[str, float] = field(default_factory=dict)

    @property
    def decode_time_upto_bs(self) -> dict[int, float]:
        """Per k in SMALL_BATCHES, decode time while at most k sequences ran: the tail, the only part of a rollout
        that speculation can speed where a step's cost grows with the tokens it carries (docs/design.md §11)."""
        return {k: sum(s for bs, (_, _, s) in self.decode_by_bs.items() if bs <= k) for k in SMALL_BATCHES}


class LLMEngine:
    def __init__(self, model: Decoder, eos_token_ids: list[int], max_num_seqs: int = 64,
                 max_model_len: int | None = None, kv_cache_tokens: int | None = None, seed: int = 0,
                 enforce_eager: bool = False, attention: str = "auto", clock=None):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # decode / verify attention (tlt.models.flex), and whether captured CUDA graphs may use it
        model.attention_backend, model.flex_in_graphs = resolve_backend(attention, self.device)
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        if kv_cache_tokens is not None and kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens}: give a positive number of positions, or None for "
                             f"no budget beyond max_num_seqs")
        self.kv = KVCache(model.cfg, max_num_seqs, self.dtype, self.device)
        self.scheduler = Scheduler(self.kv, max_num_seqs, kv_cache_tokens, self.max_model_len)
        # on CUDA, decode and verification replay captured graphs unless enforce_eager (vLLM's switch)
        # every step's cost: the device's clock, or a cost model's (tlt.engine.clock); the policy is given it
        self.clock = clock if clock is not None else WallClock(self.device)
        self.runner = ModelRunner(model, self.kv, cuda_graphs=not enforce_eager and self.device.type == "cuda",
                                  clock=self.clock)
        self.spec = None  # a speculator (tlt.speculative.SpecDecoder), set by attach_speculator
        self.hidden_records = False  # keep Sequence.hidden_record (attach_speculator)
        self.asleep = False  # sleep() freed the KV caches; add_request refuses until wake()
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seed_rng = torch.Generator().manual_seed(seed)

    # ---- requests -------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot run; queues nothing (tlt.LLM checks a whole batch first)."""
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"shorten the prompt or raise max_model_len (the model supports "
                             f"{self.model.cfg.max_position_embeddings} positions)")
        if max(prompt_ids) >= self.model.cfg.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt token id out of range [0, {self.model.cfg.vocab_size})")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be tlt.SamplingParams, got {type(params).__name__}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, group_id: int | None = None) -> list[Sequence]:
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV cache was freed for the trainer): call wake() first")
        self.check_request(prompt_ids, params)
        request_id = next(self._ids)
        group_id = request_id if group_id is None else group_id
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None \
                else int(torch.randint(2**62, (1,), generator=self._seed_rng))
            seq = Sequence(seq_id=next(self._ids), request_id=request_id, sample_index=i, group_id=group_id,
                           prompt_ids=list(prompt_ids), params=params,
                           generator=torch.Generator().manual_seed(seed), max_model_len=self.max_model_len)
            self.scheduler.add(seq)
            seqs.append(seq)
            if self.spec is not None:
                self.spec.on_add(seq)
        return seqs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- colocated placement: the trainer gets the device between rollouts (docs/design.md §13) -------
    def sleep(self) -> int:
        """Free the KV caches (target's and drafter's) and captured graphs; returns the bytes freed. Weights stay.
        Only between rollouts: a sleeping engine holds no running sequence. The caches grow back on demand at the
        next request, so `wake` only has to mark the engine usable."""
        if self.has_unfinished():
            raise RuntimeError("engine.sleep() with unfinished requests: finish the rollout first")
        caches = [self.kv, *self.scheduler.slot_caches]
        freed = sum(t.numel() * t.element_size() for c in caches for t in c.k + c.v)
        for cache in caches:
            cache.release()
        if self.runner.graphs is not None:
            self.runner.graphs.release()
        if self.spec is not None:
            self.spec.release_graphs()  # the drafter's graphs point into its cache, freed above
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True
        return freed

    def wake(self) -> None:
        self.asleep = False

    # ---- the speculator seam --------------------------------------------------------------------------------
    # A speculator (tlt.speculative.SpecDecoder) proposes drafts and verifies them; the engine owns the sequences,
    # their hidden-state records, the target's forwards, the K/V commit and the step's timing. It is told of
    # requests and finished sequences (on_add, on_tokens, on_finish), chooses each decode step's arm
    # (choose), and is given the step's cost on the engine's clock (observe).
    def attach_speculator(self, spec, slot_caches: tuple[KVCache, ...] = (), headroom: int = 0,
                          hidden_records: bool = False) -> None:
        """Let `spec` take over decode steps; `slot_caches` (the drafter's KV cache) are slot-indexed like the
        target's and move with their rows when the scheduler compacts the batch; `headroom`: positions past a
        sequence's worst-case length that its steps may write, reserved in every cache at admission;
        hidden_records: keep each running sequence's target hidden state at every position
        (`Sequence.hidden_record`, the drafter's input)."""
        self.spec = spec
        for cache in slot_caches:
            self.scheduler.add_slot_cache(cache)
        self.scheduler.headroom = max(self.scheduler.headroom, headroom)
        self.hidden_records = hidden_records

    def use_clock(self, clock) -> None:
        """Time the steps from now on with `clock` (tlt.engine.clock), the speculator's forwards too."""
        self.clock = self.runner.clock = clock
        if self.spec is not None:
            self.spec.clock = clock

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, in slot order."""
        return self.scheduler.running

    @property
    def num_slots(self) -> int:
        """Rows of the KV cache: the most sequences that can run at once."""
        return self.kv.num_slots

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured so far, the target's and the speculator's: a step that captured one costs many
        plain steps, once."""
        return self.runner.num_graph_captures + (self.spec.num_graph_captures if self.spec is not None else 0)

    @property
    def graph_capture_time_s(self) -> float:
        """Seconds spent capturing CUDA graphs so far, the target's and the speculator's (they share one pool)."""
        pool = self.graph_pool
        return pool.capture_s if pool is not None else 0.0

    @property
    def graph_pool(self) -> GraphPool | None:
        """The memory pool of this engine's CUDA graphs, for a speculator's own graphs to share; None when the
        engine runs eagerly (CPU, or enforce_eager=True): then the speculator runs eagerly too."""
        return self.runner.graphs.pool if self.runner.graphs is not None else None

    def tree_forward(self, seqs: list[Sequence], tokens: torch.Tensor, depths: torch.Tensor,
                     mask: torch.Tensor | None, nodes: torch.Tensor | None = None) -> torch.Tensor:
        """The target's forward over T candidate tokens per row placed after each row's cache (SD verification):
        tokens, depths [B, T] (position = num_cached + depth), mask [B, T, T] among them (None = causal) ->
        hidden [B, T, H]. Their K/V land at num_cached + node index; commit moves the accepted ones. nodes [B, T]
        bool: only these tokens are needed (each one's ancestors among them); where the model can compute them
        alone (ModelRunner.cached_forward) the others are not computed and their hidden states are zeros."""
        lens = [s.num_cached for s in seqs]
        self.kv.ensure_capacity(max(lens) + tokens.shape[1] + 1)
        n = host_tensor(lens, tokens.device)
        return self.runner.cached_forward(tokens, n[:, None] + depths, n, mask, nodes, context=sum(lens))

    def commit(self, seqs: list[Sequence], result, logprobs: list[list[float]], hidden: torch.Tensor) -> list[Sequence]:
        """After tree_forward and verification (result: tlt.speculative.verify.VerifyResult): move each row's
        accepted nodes' K/V into place, keep their hidden states, append the emitted tokens."""
        paths = result.paths
        idx = host_tensor([[i for i, path in enumerate(paths) for _ in path], [n for path in paths for n in path]],
                          hidden.device)
        kept = list(hidden[idx[0], idx[1]].split([len(path) for path in paths]))  # one gather, per-row views
        if self.hidden_records:
            torch._foreach_copy_([s.hidden_record[s.num_cached:s.num_cached + len(k)] for s, k in zip(seqs, kept)],
                                 kept)
        rows, src, dst = [], [], []
        for i, (s, path) in enumerate(zip(seqs, paths)):
            for j, node in enumerate(path):
                if node != j:
                    rows.append(i); src.append(s.num_cached + node); dst.append(s.num_cached + j)
        if rows:
            self.runner.move_positions(rows, src, dst)
        for s, path in zip(seqs, paths):
            s.num_cached += len(path)
        return self.append_tokens(seqs, result.emitted_ids, logprobs, kept)

    def _keep_hidden(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """A plain step's hidden states [B, H] into each row's record, at the position it just cached."""
        if self.hidden_records:
            torch._foreach_copy_([s.hidden_record[s.num_cached - 1] for s in seqs], list(hidden.unbind(0)))

    def _start_records(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Prefill's hidden states [B, T, H] start each row's record, sized for its whole length and the headroom
        (zeros where nothing was kept)."""
        if self.hidden_records:
            for i, s in enumerate(seqs):
                s.hidden_record = hidden.new_zeros(s.max_total_len + self.scheduler.headroom, hidden.shape[-1])
                s.hidden_record[:len(s.prompt_ids)] = hidden[i, :len(s.prompt_ids)]

    # ---- one step -------------------------------------------------------------------------------------------
    @torch.inference_mode()  # caches grown mid-step must be inference tensors everywhere they are touched
    def step(self) -> list[Sequence]:
        """Run one prefill or decode step; return the sequences that finished in it."""
        admitted = self.scheduler.admit()
        clock = self.clock
        clock.start()
        if admitted:
            logits, last, hidden = self.runner.prefill(admitted)
            self._start_records(admitted, hidden)
            done = self.sample_and_append(admitted, logits, last)
            self.stats.num_prefill_steps += 1
            self.stats.prefill_time_s += clock.stop("prefill")
        else:
            seqs = self.scheduler.running
            captures = self.num_graph_captures
            arm = self.spec.choose(seqs) if self.spec is not None else None
            if arm is None or arm.method == "off":
                logits, hidden = self.runner.decode(seqs)
                self._keep_hidden(seqs, hidden)
                done = self.sample_and_append(seqs, logits, hidden)
                emitted, seconds = len(seqs), clock.stop("plain")
            else:
                before = sum(len(s.output_ids) for s in seqs)
                draft = self.spec.propose(seqs, arm)
                clock.mark("propose")
                hidden = self.tree_forward(seqs, draft.tokens, draft.depths, draft.mask, draft.nodes)
                result, logprobs = self.spec.verify(seqs, draft, hidden)
                clock.mark("verify")
                done = self.commit(seqs, result, logprobs, hidden)
                clock.mark("commit")
                # the tokens appended: a row's emitted tokens past its stop (EOS, max_tokens) are dropped
                emitted, seconds = sum(len(s.output_ids) for s in seqs) - before, clock.stop("sd")
                self.stats.num_spec_steps += 1
                for phase, s in clock.phases.items():
                    self.stats.spec_phase_time_s[phase] = self.stats.spec_phase_time_s.get(phase, 0.0) + s
            if self.spec is not None:  # a step that captured a CUDA graph (once, many steps' cost) says nothing
                self.spec.observe(seqs, arm, emitted, seconds, self.num_graph_captures != captures)
            self.stats.num_decode_steps += 1
            self.stats.decode_time_s += seconds
            by_bs = self.stats.decode_by_bs.setdefault(len(seqs), [0, 0, 0.0])
            by_bs[0] += 1
            by_bs[1] += emitted
            by_bs[2] += seconds
        self.scheduler.finish(done)
        for s in done:
            s.hidden_record = None
        if self.spec is not None:
            self.spec.on_finish(done)
        return done

    def sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor) -> list[Sequence]:
        """Sample one token per row from logits [B, V] (hidden [B, H] produced them), append it with its stop
        rules; returns the sequences that finished. The sampled ids are the step's one read of the device."""
        tokens, logprobs = read_sampled(*self.sample(seqs, logits))
        return self.append_tokens(seqs, [[t] for t in tokens], [[x] for x in logprobs], hidden[:, None])

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from logits [B, V] -> (ids [B], their log-probs [B]) on the logits' device, nothing
        read from it off the CPU (where a read waits for the device). Each row that samples takes one uniform from
        its own generator, in row order (none when every row is greedy): the draws SD's verification takes too
        (docs/design.md §7), so a seeded request gets the same tokens whatever shares its batch, SD on or off."""
        static = logits.device.type != "cpu"
        if all(s.params.temperature == 0 for s in seqs):
            return greedy(logits, static)
        temp, top_k, top_p = ([s.params.temperature for s in seqs], [s.params.top_k for s in seqs],
                              [s.params.top_p for s in seqs])
        u = torch.cat([torch.rand(1, generator=s.generator) for s in seqs])
        V = logits.shape[-1]
        return sample(logits, rows_on_device(temp, top_k, top_p, u, V, logits.device),
                      HostRows.of(temp, top_k, top_p, V), static)

    def append_tokens(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list[float]],
                      hidden: torch.Tensor | list | None = None) -> list[Sequence]:
        """Append emitted tokens per sequence (one, or several under speculation), applying stop rules in order.
        hidden: per sequence a [k, H] tensor of the states that produced its k tokens (or None)."""
        done = []
        if hidden is not None and any(s.params.return_hidden_states for s in seqs):
            t0 = time.perf_counter()
            # the step's states in one host copy, bf16 (drafter data): a copy per row would wait for the device once
            # per row (docs/design.md §3)
            sizes = [len(h) for h in hidden]
            flat = hidden.flatten(0, 1) if isinstance(hidden, torch.Tensor) else torch.cat(list(hidden))
            hidden = flat.to("cpu", torch.bfloat16).split(sizes)
            self.stats.hidden_copy_time_s += time.perf_counter() - t0
        for i, (seq, toks, lps) in enumerate(zip(seqs, tokens, logprobs)):
            p = seq.params
            before = len(seq.output_ids)
            for j, (tok, lp) in enumerate(zip(toks, lps)):
                seq.output_ids.append(tok)
                seq.logprobs.append(lp)
                if p.return_hidden_states:
                    if hidden is not None:
                        seq.hidden.append(hidden[i][j])
                    else:  # a gap: the kept states restart after this token (one contiguous run)
                        seq.hidden.clear()
                        seq.hidden_start = len(seq.output_ids)
                self.stats.num_generated_tokens += 1
                if (tok in self.eos_token_ids and not p.ignore_eos) or (p.stop_token_ids and tok in p.stop_token_ids):
                    seq.finish_reason = "stop"
                elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
                if seq.finish_reason:
                    done.append(seq)
                    break
            if self.spec is not None:
                self.spec.on_tokens(seq, seq.output_ids[before:])
        return done

"""tlt.LLM: vLLM-shaped offline generation API over the continuous-batching engine.

    llm = tlt.LLM(model="path/to/hf_dir")
    outs = llm.generate([[1, 2, 3]], tlt.SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].token_ids, .text, .logprobs, .finish_reason

`clock` (tlt.engine.clock) times the engine's steps for the speculation policy: the device's clock by default, or a
VirtualClock that charges each forward from a device profile (decode on the CPU as another device would cost).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from tqdm import tqdm

from tlt.device import resolve_device, resolve_dtype
from tlt.engine.llm_engine import LLMEngine
from tlt.engine.outputs import CompletionOutput, RequestOutput
from tlt.engine.params import SamplingParams
from tlt.models.decoder import Decoder
from tlt.models.loader import load_model, load_tokenizer
from tlt.models.smollm import default_model_path
from tlt.speculative.config import SpecConfig
from tlt.speculative.spec_decoder import SpecDecoder


def eos_ids_of(model_dir: Path, model: Decoder, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, the tokenizer and config.json, merged."""
    ids = set(model.cfg.eos_token_id)
    gen = model_dir / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([e] if isinstance(e, int) else (e or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLM:
    def __init__(self, model: str | Path | Decoder | None = None, tokenizer: Any = None, dtype: str = "auto",
                 device: str = "auto", max_num_seqs: int = 64, max_model_len: int | None = None,
                 kv_cache_tokens: int | None = None, seed: int = 0, speculative_config: dict | SpecConfig | None = None,
                 skip_tokenizer_init: bool = False, enforce_eager: bool = False, attention: str = "auto",
                 clock=None):
        if model is None:
            model = default_model_path()
        model_dir = None
        if isinstance(model, Decoder):
            self.model = model
        else:
            model_dir = Path(model)
            dev = resolve_device(device)
            self.model = load_model(model_dir, dtype=resolve_dtype(dtype, dev), device=str(dev))
        has_tok_files = model_dir is not None and any(
            (model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        if tokenizer is None and has_tok_files and not skip_tokenizer_init:
            tokenizer = load_tokenizer(model_dir)  # without tokenizer files: token-id prompts only
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.model, eos_ids_of(model_dir, self.model, tokenizer), max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, kv_cache_tokens=kv_cache_tokens, seed=seed,
                                enforce_eager=enforce_eager, attention=attention, clock=clock)
        self.spec = None
        if speculative_config is not None:
            cfg = speculative_config if isinstance(speculative_config, SpecConfig) \
                else SpecConfig.from_dict(speculative_config)
            if cfg.enabled:
                self.spec = SpecDecoder.from_config(self.engine, cfg)

    def _to_token_ids(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, dict):
                p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer: pass tokenizer= or give prompt_token_ids")
                p = self.tokenizer(p, add_special_tokens=False)["input_ids"]
            out.append(list(p))
        return out

    def generate(self, prompts=None, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, group_ids: list[int] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for a batch of prompts (text, token-id lists or {"prompt_token_ids": [...]} dicts)."""
        token_ids = self._to_token_ids(prompt_token_ids if prompt_token_ids is not None else prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_ids)} prompts")
        if group_ids is not None and len(group_ids) != len(token_ids):
            raise ValueError(f"got {len(group_ids)} group_ids for {len(token_ids)} prompts")
        engine = self.engine
        for i, (ids, p) in enumerate(zip(token_ids, params)):  # all checked before any is queued
            try:
                engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        requests = []
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            requests.append(engine.add_request(ids, p, None if group_ids is None else group_ids[i]))
        total = sum(len(r) for r in requests)
        with tqdm(total=total, disable=not use_tqdm, desc="generate", unit="seq") as bar:
            while engine.has_unfinished():
                bar.update(len(engine.step()))
        return [self._request_output(seqs, ids) for seqs, ids in zip(requests, token_ids)]

    def _request_output(self, seqs, prompt_ids) -> RequestOutput:
        outs = []
        for s in seqs:
            text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True) if self.tokenizer else ""
            hidden = torch.stack(s.hidden) if s.hidden else None
            outs.append(CompletionOutput(s.sample_index, text, s.output_ids, s.logprobs, s.finish_reason,
                                         float(sum(s.logprobs)), hidden, s.hidden_start))
        return RequestOutput(seqs[0].request_id, None, prompt_ids, outs, seqs[0].group_id)

    def chat(self, messages, sampling_params: SamplingParams | None = None, **kw) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in
               (self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs)]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, **kw)

    def stats(self) -> dict:
        s = self.engine.stats
        out = {"num_generated_tokens": s.num_generated_tokens, "num_decode_steps": s.num_decode_steps,
               "num_spec_steps": s.num_spec_steps, "decode_time_s": s.decode_time_s, "prefill_time_s": s.prefill_time_s,
               "hidden_copy_time_s": s.hidden_copy_time_s,
               # CUDA graphs captured and the seconds it took (in the decode and SD step times that include them)
               "graph_captures": self.engine.num_graph_captures,
               "graph_capture_time_s": self.engine.graph_capture_time_s,
               "decode_time_upto_bs": {str(k): v for k, v in s.decode_time_upto_bs.items()},
               "decode_by_bs": {bs: tuple(v) for bs, v in sorted(s.decode_by_bs.items())},
               # SD steps' time by phase (drafting, the target's verification, the commit) on the engine's clock
               **{f"sd_{phase}_time_s": v for phase, v in s.spec_phase_time_s.items()}}
        if self.spec is not None:
            out.update(self.spec.stats())
        return out

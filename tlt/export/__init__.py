"""Deploying tlt's drafter elsewhere: `tlt export-drafter` writes it as a vLLM EAGLE draft model with a test vector
(tlt.export.vllm); SGLang's EAGLE-1 layout is tlt.export.eagle."""

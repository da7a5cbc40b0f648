"""The engine: one machine's share of a model (`stage`), sampling, and single-process generation."""

# Prompt tokens per prefill step, in `kafila run` and in a session alike (`--chunk` in both): a long
# prompt then goes through the same products in the same steps, so greedy tokens agree between them.
PREFILL_CHUNK = 256

# The dtypes a model computes in, by their command-line names, with their safetensors names
# (kafila.engine.backend); "auto" picks the checkpoint's own (bf16 on a GPU where none is given).
DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
DTYPE_CHOICES = ("auto", *DTYPES)
# Weight formats (kafila.models.manifest.QUANT_FORMATS, docs/engine-quant.md); "auto": the checkpoint's own.
QUANT_CHOICES = ("auto", "none", "int8", "q4")

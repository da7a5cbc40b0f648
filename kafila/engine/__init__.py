"""The engine: one machine's share of a model (`stage`), sampling, and single-process generation."""

# Prompt tokens per prefill step, in `kafila run` and in a session alike (`--chunk` in both): a long
# prompt then goes through the same products in the same steps, so greedy tokens agree between them.
PREFILL_CHUNK = 256

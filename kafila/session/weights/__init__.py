"""Weights: the manifest of a checkpoint, serving it by byte range, fetching a shard, the local cache."""

"""Datasets on disk: the shard format (``shards``), a synthetic generator that follows a
spec's data distribution (``synth``), distribution statistics from the index (``stats``),
decoding samples into the arrays a model reads (``decode``) and the ``dtc data`` commands
(``cli``).
"""

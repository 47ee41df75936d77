"""Datasets, decoding, augmentation, packed shards and the loaders that batch them for one rank."""

"""Trainer adapters over `pipeline.consumer.Consumer`: slime (adapter, its Sample
types, start-up checks, metrics), PyTorch (an IterableDataset), and evaluation passes."""

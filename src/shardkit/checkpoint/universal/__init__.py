"""The universal checkpoint layout: every strategy's state as DCP shards keyed by the unwrapped model's names."""

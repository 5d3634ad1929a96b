"""Small utilities shared across shardkit."""

"""Selection cores: torch-only rules that pick rows or windows of one shard (see base.py)."""

"""Checkpoint files: Megatron's layout, sharding rules, Hugging Face conversion."""

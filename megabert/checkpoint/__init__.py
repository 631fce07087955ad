"""Checkpoints, read and written in one place: Megatron's file layout, sharding rules, the one
reader every load goes through, Hugging Face and TF conversion, and saving / resuming a
training run (manager: one CheckpointManager over the run's stateful parts)."""

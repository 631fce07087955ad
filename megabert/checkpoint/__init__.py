"""Checkpoints, read and written in one place: Megatron's file layout, sharding rules, the one
reader every load goes through, Hugging Face and TF conversion, and saving / resuming a
training run (run_state: the start point, the rank files with optimizer and RNG state)."""

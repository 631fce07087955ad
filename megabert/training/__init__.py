"""Generic training, knowing no task: the run resolved once from the flags, the DeepSpeed
JSON and the world (resolve.py), the one driver of every entry script (driver.py), the
trainer loop, the strategies that apply an update (ours in strategy.py, DeepSpeed's behind
its one door in deepspeed/), what every fine-tuning task shares (finetune.py), mixed
precision, gradient reductions (overlapped with backward), metrics and logs. Checkpoint
files are megabert.checkpoint's."""

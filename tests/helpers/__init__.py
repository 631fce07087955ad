"""Code that test modules share (no test module imports another): the spawned gloo worker
pool (dist_utils), a tiny trainer and dataset (train_utils), entry scripts run in process
(cli_utils), pretrain_bert.py runs as a user types them (pretrain_runs), tiny transformers
models (hf_models), GLUE files (glue_files) and the fused kernels' oracle checks (kernel_checks)."""

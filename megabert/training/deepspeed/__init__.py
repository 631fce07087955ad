"""DeepSpeed, behind one door: its config (built from our flags or merged from a
--deepspeed_config), the engine, the ZeRO strategy with its checkpoint files, the CPU Adam
of ZeRO-Offload, and the version guard for the private attributes we touch. Only
megabert.training.build (which builds the strategy) and megabert.training.resolve (which
merges the JSON into the resolved run) import this package."""

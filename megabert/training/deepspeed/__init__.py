"""DeepSpeed, behind one door: its config (built from our flags or merged from a
--deepspeed_config; the only code that reads DeepSpeed's JSON, handing the rest of megabert
a typed ZeroPlan), the engine with the `mpu` adapter over our ParallelState, the ZeRO
strategy with its checkpoint files (SAVE/deepspeed/), the counter that puts DeepSpeed's
collectives in megabert's communication ledger, the CPU Adam of ZeRO-Offload, and the
version guard for the private attributes we touch. The core packages (parallel, model,
checkpoint, tensor/pipeline parallel, ops) never name DeepSpeed. Only megabert.training.build
(which builds the strategy) and megabert.training.resolve (which merges the JSON into the
resolved run) import this package."""

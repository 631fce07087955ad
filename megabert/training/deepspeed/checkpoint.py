"""DeepSpeed's run as the checkpoint manager's parts (megabert.checkpoint.manager): the
engine's ZeRO partitions in its own files beside our rank files, and under ZeRO-3 the
weights gathered for them (our rank files always hold whole TP-local weights)."""
from __future__ import annotations

import os
import shutil

from megabert.checkpoint.layout import tag_dir_name
from megabert.checkpoint.manager import CheckpointParts
from megabert.checkpoint.run_state import RNGStreams, TrainingState
from megabert.checkpoint.start import Source
from megabert.errors import CheckpointError
from megabert.training.checkpoint_state import ModelWeights
from megabert.training.deepspeed.strategy import DeepSpeedStrategy

DEEPSPEED_SUBDIR = "deepspeed"  # DeepSpeed's ZeRO files, beside our rank files: SAVE/deepspeed/iter_NNNNNNN/


class PartitionedWeights(ModelWeights):
    """ZeRO-3 leaves each rank a partition of every parameter (an empty tensor in
    state_dict()), so our rank files, and with them export, resharding and weights-only
    starts, need them gathered: one parameter at a time over the data-parallel group
    (every rank takes part), kept where `keep`."""

    def state_dict(self, keep: bool = True) -> dict:
        import deepspeed

        params = dict(self.model.named_parameters())
        out = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if name in params:
                with deepspeed.zero.GatheredParameters([params[name]]):
                    if keep:
                        out[name] = params[name].detach().cpu().clone()
            elif keep:
                out[name] = value.detach().cpu()
        return out


class DeepSpeedFiles:
    """The engine's optimizer (its ZeRO partitions, its fp32 masters) in DeepSpeed's own files."""

    name, flag = "DeepSpeed", "--deepspeed"

    def __init__(self, strategy: DeepSpeedStrategy):
        self.strategy = strategy

    def save_files(self, root: str, state: TrainingState) -> None:
        self.strategy.engine.save_checkpoint(os.path.join(root, DEEPSPEED_SUBDIR), tag=tag_dir_name(state.iteration),
                                             client_state={"iteration": state.iteration,
                                                           "consumed_samples": state.consumed_samples})

    def discard_files(self, root: str, state: TrainingState) -> None:
        # Kept when a committed checkpoint of this iteration uses them (a failed re-save).
        if not os.path.isdir(os.path.join(root, tag_dir_name(state.iteration))):
            shutil.rmtree(os.path.join(root, DEEPSPEED_SUBDIR, tag_dir_name(state.iteration)), ignore_errors=True)

    def load_files(self, source: Source, state: TrainingState) -> None:
        # NOTE: DeepSpeed reads its ZeRO files with torch.load(weights_only=False), which
        # unpickles: resume only checkpoints you trust (README, "Checkpoints").
        ds_dir = os.path.join(source.root, DEEPSPEED_SUBDIR)  # beside the rank files (a megabert checkpoint)
        if not os.path.isdir(ds_dir):
            raise CheckpointError(f"{source.path} has no {DEEPSPEED_SUBDIR}/ directory: it was not saved with "
                                  f"--deepspeed; drop --deepspeed or load the weights only with --finetune")
        _, client = self.strategy.engine.load_checkpoint(ds_dir, tag=tag_dir_name(state.iteration),
                                                         load_optimizer_states=True, load_lr_scheduler_states=False)
        if client is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint for iteration {state.iteration} in {ds_dir}")

    def weights_loaded(self) -> None:
        """New weights in the engine's module do not reach its fp32 master copies (ZeRO
        partitions, fp16/bf16 wrappers): its first step would write the old weights back.
        DeepSpeed's own module-only load refreshes them the same way. Every optimizer DeepSpeed
        wraps ours in (ZeRO 1/2/3, its fp16 and bf16 ones: DeepSpeedOptimizer, 0.19) keeps masters
        and refreshes them; unwrapped (fp32 without ZeRO) ours steps the module's own
        parameters and there is nothing to refresh."""
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        optimizer = self.strategy.engine.optimizer
        if isinstance(optimizer, DeepSpeedOptimizer):
            optimizer.refresh_fp32_params()


def deepspeed_parts(strategy: DeepSpeedStrategy) -> CheckpointParts:
    """What a DeepSpeed run's checkpoints hold: our rank files without an optimizer (the
    engine's files keep it; DeepSpeed's loss scale is in them too)."""
    model = strategy.model
    weights = (PartitionedWeights if strategy.zero_stage == 3 else ModelWeights)(model, strategy.ps)
    return CheckpointParts(model=weights, rng=RNGStreams(model.rng), engine=DeepSpeedFiles(strategy))

"""Pipeline parallelism: point-to-point transfers between stages and the schedules
(1F1B, interleaved 1F1B, forward-only) that run micro-batches through them."""
from megabert.pipeline_parallel.p2p import PipeComm, pipeline_dtype
from megabert.pipeline_parallel.schedules import PipelineSchedule, check_interleaving

__all__ = ["PipeComm", "pipeline_dtype", "PipelineSchedule", "check_interleaving"]

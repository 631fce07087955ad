"""Layout planner: predicted per-rank memory and per-step communication of a parallel
layout, and the layouts that fit a memory budget, before a run starts.

    from megabert.config import bert_large
    from megabert.planning import Layout, Workload, estimate, fit_warning, plan
    est = estimate(bert_large(), Workload(precision="bf16"), Layout(tp=2, dp=4, zero_stage=1))
    est.total_gb, est.breakdown(), fit_warning(est, budget_gb=16)
    plan(bert_large(), Workload(global_batch_size=1024), devices=8, budget_gb=80)  # best first

Files by concern: spec (inputs), params (counts per rank), activations, memory,
communication, search, preflight (from pretrain_bert.py's configs). tools/plan_layout.py
is the CLI; bench/memory.py checks the predictions against measured peaks.
"""
from megabert.planning.communication import CommEstimate, communication
from megabert.planning.memory import MemoryEstimate, estimate
from megabert.planning.preflight import Preflight, log_preflight, preflight, preflight_warning, run_and_layout
from megabert.planning.search import Candidate, candidate_layouts, fit_warning, plan
from megabert.planning.spec import Layout, Workload

__all__ = ["Candidate", "CommEstimate", "Layout", "MemoryEstimate", "Preflight", "Workload", "candidate_layouts",
           "communication", "estimate", "fit_warning", "log_preflight", "plan", "preflight", "preflight_warning", "run_and_layout"]

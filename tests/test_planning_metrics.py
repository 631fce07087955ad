"""peak_memory_gb: the training log's mem_peak_gb, on CPU the process's peak RSS."""
import resource

import pytest
import torch

from megabert.training.metrics import peak_memory_gb


def test_cpu_peak_is_rss_and_grows_with_a_large_tensor():
    before = peak_memory_gb("cpu")
    assert before == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, rel=0.01)
    # Above the peak so far, touched so it is resident: the peak must rise by about its size
    # (a peak_memory_gb that returned a stale or constant figure would not).
    x = torch.ones(int((before + 0.3) * 1e9 / 4))
    after = peak_memory_gb(torch.device("cpu"))
    assert after >= before + 0.25, (before, after)
    del x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_counts_allocated_tensors():
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    assert peak_memory_gb("cuda") >= 0.268
    del x


def _heavy_rank_worker(rank, world, argv):
    from tests.helpers.train_utils import train_worker

    # Rank 1 alone touches 800 MB before training: the logged peak must be the largest rank's.
    ballast = torch.ones(200 * 1024 * 1024) if rank == 1 else None
    train_worker(rank, world, argv)
    del ballast


def test_training_log_reports_the_largest_rank_peak(tmp_path):
    import json

    from tests.helpers.dist_utils import run_distributed

    path = tmp_path / "m.jsonl"
    run_distributed(_heavy_rank_worker, 2, ["--train-iters", "2", "--metrics-file", str(path)])
    peaks = [json.loads(line)["mem_peak_gb"] for line in open(path) if "mem_peak_gb" in line]
    assert len(peaks) == 2  # every logged step
    assert peaks[0] >= 0.8 and peaks[1] >= peaks[0]  # rank 1's ballast; a peak never falls

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist_utils.py for spawned workers
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_parallel_state():
    """Each test starts without a process group left over from another."""
    yield
    from megabert.parallel import destroy_parallel

    destroy_parallel()

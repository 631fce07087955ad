import json
import os
import random

import pytest
import torch

from tests.helpers.cli_utils import run_main
from tests.helpers.compiler_state import reset_compiler_state

torch.set_num_threads(2)
# Inductor compiles its C++ in a pool of worker interpreters (one per core by default): the
# suite's two pytest workers already keep both cores busy, so the pool only adds start-ups
# (measured: the two --compile tests 89 -> 80 CPU-seconds with a cold cache, wall no longer).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")



@pytest.fixture(autouse=True)
def _fresh_parallel_state():
    """Each test starts without a process group left over from another."""
    yield
    from megabert.parallel import destroy_parallel

    destroy_parallel()


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """Forget what megabert.ops already said once (megabert.say_once), and capture what it says now."""
    import logging

    import megabert.say_once

    monkeypatch.setattr(megabert.say_once, "_said", set())
    caplog.set_level(logging.INFO, logger="megabert.ops")
    return caplog


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    """A test that compiled leaves dynamo's caches as a fresh process would find them
    (tests.helpers.compiler_state)."""
    yield
    reset_compiler_state()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the model reads every sentence and predicts masked words from context while a second head "
         "decides whether two segments appear in their original order data parallel ranks share "
         "gradients tensor parallel ranks split matrices pipeline stages pass activations").split()


def _corpus(path, docs=120, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
                     for _ in range(rng.randint(3, 8))]
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small corpus through the user's tools (train_tokenizer.py, preprocess_data.py, their main()):
    vocab.txt and c_text_sentence.bin/.idx, made once for every end-to-end module. Tests
    only read it."""
    d = tmp_path_factory.mktemp("data")
    _corpus(d / "corpus.jsonl")
    for tool, *argv in (
            ("tools/train_tokenizer.py", "--input", d / "corpus.jsonl", "--output", d / "vocab.txt", "--vocab-size", 200,
             "--min-frequency", 1),
            ("tools/preprocess_data.py", "--input", d / "corpus.jsonl", "--output-prefix", d / "c", "--json-keys", "text",
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", d / "vocab.txt", "--split-sentences",
             "--workers", 1)):
        r = run_main(tool, *map(str, argv))  # in process: the tools' command lines are the demo's
        assert r.returncode == 0, r.stderr
    return d

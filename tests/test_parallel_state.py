"""The parallel state is made by init_parallel() and passed on, never created on first use: a
model built with no state and no init_parallel() is a one-line error, while the Python API's
door (`from_pretrained(path)`) sets up a single process itself, as DESIGN's Python API says."""
import pytest
import torch

import megabert
from megabert.parallel import get_parallel_state

from tests.helpers.hf_models import batch, make_hf_dir


def test_without_init_parallel_the_state_is_an_error():
    with pytest.raises(megabert.ConfigError, match=r"init_parallel\(\) was not called: call it first"):
        get_parallel_state()
    with pytest.raises(megabert.ConfigError, match=r"init_parallel\(\) was not called"):
        megabert.BertForPreTraining(megabert.bert_tiny(vocab_size=100))


def test_a_model_built_with_no_state_takes_init_parallels():
    ps = megabert.init_parallel()
    assert get_parallel_state() is ps
    assert megabert.BertForPreTraining(megabert.bert_tiny(vocab_size=100)).parallel_state is ps


def test_from_pretrained_sets_up_a_single_process_itself(tmp_path):
    path = make_hf_dir(tmp_path / "hf")
    model = megabert.BertForPreTraining.from_pretrained(path)  # no init_parallel() before
    ps = get_parallel_state()
    assert model.parallel_state is ps and ps.world_size == 1
    ids, tt, am, _ = batch()
    with torch.no_grad():
        assert model(ids, token_type_ids=tt, attention_mask=am).mlm_logits.shape[:2] == ids.shape
    # A second load keeps the state the first one made.
    assert megabert.AutoModelForMaskedLM.from_pretrained(path).parallel_state is ps

"""The whole model equals transformers' BERT loaded with the same weights: logits,
losses and every parameter gradient, fp32, at TP 1 and 2, with padded rows."""
import pytest
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.training.grads import sync_sequence_parallel_grads

from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import batch, close, make_hf_dir


transformers = pytest.importorskip("transformers")

def _check_pretraining(rank, world, hf_dir, backend, sequence_parallel):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf = transformers.BertForPreTraining.from_pretrained(hf_dir, attn_implementation="eager")
    ids, tt, am, labels = batch()
    nsl = torch.tensor([0, 1, 0])
    ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, labels=labels, next_sentence_label=nsl)
    ref.loss.backward()

    model = megabert.BertForPreTraining.from_pretrained(hf_dir, ps, attention_backend=backend,
                                                        sequence_parallel=sequence_parallel)
    out = model(ids, token_type_ids=tt, attention_mask=am, labels=labels, next_sentence_label=nsl)
    out.loss.backward()
    close(out.mlm_logits, ref.prediction_logits, "mlm logits")
    close(out.nsp_logits, ref.seq_relationship_logits, "nsp logits")
    close(out.loss, ref.loss, "loss")

    # LayerNorm grads are partial per sequence slice: the trainer's reduction sums them.
    sync_sequence_parallel_grads(list(model.parameters()), ps)
    grads = {n: p.grad for n, p in model.named_parameters()}
    hf_grads = megabert_to_hf(gather_full(grads, ps, spec_table(model)), spec_table(model))
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(hf_grads) == set(ref_grads) - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    for name, g in hf_grads.items():
        close(g, ref_grads[name], f"grad {name}")


def _check_qa(rank, world, hf_dir):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf = transformers.BertForQuestionAnswering.from_pretrained(hf_dir, attn_implementation="eager")
    ids, tt, am, _ = batch(2)
    start, end = torch.tensor([1, 3, 20]), torch.tensor([2, 4, 6])  # 20 is outside: ignored
    ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am, start_positions=start, end_positions=end)
    ref.loss.backward()
    model = megabert.BertForQuestionAnswering.from_pretrained(hf_dir, ps, attention_backend="torch")
    out = model(ids, token_type_ids=tt, attention_mask=am, start_positions=start, end_positions=end)
    out.loss.backward()
    close(out.start_logits, ref.start_logits, "start logits")
    close(out.end_logits, ref.end_logits, "end logits")
    close(out.loss, ref.loss, "loss")
    hf_grads = megabert_to_hf(gather_full({n: p.grad for n, p in model.named_parameters()}, ps, spec_table(model)),
                              spec_table(model))
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, g in hf_grads.items():
        close(g, ref_grads[name], f"grad {name}")


@pytest.mark.parametrize("world,backend", [(1, "torch"), (1, "sdpa"), (2, "torch"), (2, "sdpa")])
def test_pretraining_equals_transformers(tmp_path, world, backend):
    run_distributed(_check_pretraining, world, make_hf_dir(tmp_path / "hf"), backend, False)


def test_pretraining_sequence_parallel_equals_transformers(tmp_path):
    run_distributed(_check_pretraining, 2, make_hf_dir(tmp_path / "hf"), "torch", True)


@pytest.mark.parametrize("world", [1, 2])
def test_question_answering_equals_transformers(tmp_path, world):
    run_distributed(_check_qa, world, make_hf_dir(tmp_path / "hf", "BertForQuestionAnswering"))

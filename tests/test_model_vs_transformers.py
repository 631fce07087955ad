"""The whole model equals transformers' BERT loaded with the same weights: logits,
losses and every parameter gradient, fp32, at TP 1 and 2, with padded rows."""
import pytest
import torch
from dist_utils import run_distributed

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.training.grads import sync_sequence_parallel_grads

transformers = pytest.importorskip("transformers")

VOCAB = 99  # not a multiple of 128: exercises vocab padding


def make_hf_dir(path, arch="BertForPreTraining", dropout=0.0, **config):
    """A tiny transformers model of `arch` saved at `path`; `config` adds BertConfig keys (num_labels)."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout, **config)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():  # non-trivial biases and LayerNorms, so a swapped name would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return str(path)


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, 12), generator=gen)
    tt = torch.zeros_like(ids)
    tt[:, 6:] = 1
    am = torch.ones_like(ids)
    am[1, 8:] = 0  # padded rows
    am[2, 5:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    labels[0, 7] = ids[0, 7]
    return ids, tt, am, labels


def _close(a, b, what, atol=1e-5):
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    diff = (a - b).abs().max().item()
    assert diff <= atol + 1e-5 * b.abs().max().item(), f"{what}: max diff {diff}"


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
    _close(out.mlm_logits, ref.prediction_logits, "mlm logits")
    _close(out.nsp_logits, ref.seq_relationship_logits, "nsp logits")
    _close(out.loss, ref.loss, "loss")

    # LayerNorm grads are partial per sequence slice: the trainer's reduction sums them.
    sync_sequence_parallel_grads(list(model.parameters()), ps)
    grads = {n: p.grad for n, p in model.named_parameters()}
    hf_grads = megabert_to_hf(gather_full(grads, ps, spec_table(model)), spec_table(model))
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(hf_grads) == set(ref_grads) - {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    for name, g in hf_grads.items():
        _close(g, ref_grads[name], f"grad {name}")


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
    _close(out.start_logits, ref.start_logits, "start logits")
    _close(out.end_logits, ref.end_logits, "end logits")
    _close(out.loss, ref.loss, "loss")
    hf_grads = megabert_to_hf(gather_full({n: p.grad for n, p in model.named_parameters()}, ps, spec_table(model)),
                              spec_table(model))
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, g in hf_grads.items():
        _close(g, ref_grads[name], f"grad {name}")


@pytest.mark.parametrize("world,backend", [(1, "torch"), (1, "sdpa"), (2, "torch"), (2, "sdpa")])
def test_pretraining_equals_transformers(tmp_path, world, backend):
    run_distributed(_check_pretraining, world, make_hf_dir(tmp_path / "hf"), backend, False)


def test_pretraining_sequence_parallel_equals_transformers(tmp_path):
    run_distributed(_check_pretraining, 2, make_hf_dir(tmp_path / "hf"), "torch", True)


@pytest.mark.parametrize("world", [1, 2])
def test_question_answering_equals_transformers(tmp_path, world):
    run_distributed(_check_qa, world, make_hf_dir(tmp_path / "hf", "BertForQuestionAnswering"))

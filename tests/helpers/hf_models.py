"""A tiny transformers BERT saved to a directory (the reference megabert is compared with),
a fixed batch with padded rows, and the closeness check those comparisons use."""
import torch

VOCAB = 99  # not a multiple of 128: exercises vocab padding


def make_hf_dir(path, arch="BertForPreTraining", dropout=0.0, **config):
    """A tiny transformers model of `arch` saved at `path`; `config` adds BertConfig keys (num_labels)."""
    import transformers  # the test extra; imported here so that importing this module never skips

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


def close(a, b, what, atol=1e-5):
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    diff = (a - b).abs().max().item()
    assert diff <= atol + 1e-5 * b.abs().max().item(), f"{what}: max diff {diff}"

"""A tiny transformers ModernBERT saved to a directory (the reference megabert's ModernBERT
is compared with) and a batch whose rows are longer than the local window."""
import torch

VOCAB = 99  # not a multiple of 128: exercises vocab padding
SEQ = 24  # longer than the window (local_attention 8: a token sees 4 on each side)
PAD_ID = 0


def make_modernbert_dir(path, arch="ModernBertForMaskedLM", **config):
    """A transformers `arch` of 4 layers (global, local, local, global: both kinds, and a split
    over 2 pipeline stages), non-trivial norm weights and biases so that a swapped name would
    show; `config` adds or replaces ModernBertConfig keys."""
    import transformers  # the test extra; imported here so that importing this module never skips

    keys = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64, local_attention=8, initializer_range=0.2, pad_token_id=PAD_ID, bos_token_id=1, cls_token_id=1,
                eos_token_id=2, sep_token_id=2)
    keys.update(config)
    cfg = transformers.ModernBertConfig(**keys)
    return save_perturbed(getattr(transformers, arch), cfg, path)


def save_perturbed(model_class, cfg, path) -> str:
    """`model_class(cfg)` from seed 0 with its norm weights and biases moved off their init (so a
    swapped name would show), saved to `path` as transformers saves it."""
    torch.manual_seed(0)
    model = model_class(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return str(path)


def modernbert_batch(seed=1):
    """ids [3, SEQ] with right-padded rows (one shorter than the window's reach), labels at a
    few positions (-100 elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=gen)
    am = torch.ones_like(ids)
    am[1, 17:] = 0
    am[2, 6:] = 0
    ids[am == 0] = PAD_ID
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    labels[0, 20] = ids[0, 20]
    labels[1, 11] = ids[1, 11]
    return ids, am, labels


SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]  # ids 0-4: pad 0, cls 1, sep 2 as the config says


def save_tokenizer(path, texts, vocab_size=VOCAB):
    """A BPE tokenizer.json (+ tokenizer_config.json) trained on `texts`, saved as transformers
    saves ModernBERT's (a PreTrainedTokenizerFast that adds [CLS] ... [SEP])."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]",
                                                sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]")
    fast.save_pretrained(str(path))
    return str(path)


def masked_lm_reference(hf_dir, impl):
    """transformers' masked LM of `hf_dir` (any family: AutoModelForMaskedLM) with attention `impl`,
    its output on modernbert_batch() with labels, and the gradients of its loss on the parameters."""
    import transformers

    hf = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, attn_implementation=impl)
    ids, am, labels = modernbert_batch()
    ref = hf(input_ids=ids, attention_mask=am, labels=labels)
    ref.loss.backward()
    return hf, ref

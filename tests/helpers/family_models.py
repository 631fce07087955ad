"""Tiny transformers models of the families beyond BERT and ModernBERT, saved with transformers'
own classes (no download): the references megabert's families are compared with (on
tests.helpers.modernbert_models' right-padded batch)."""
from tests.helpers.modernbert_models import PAD_ID, VOCAB, save_perturbed


def family_config(family: str, **config):
    """(transformers' config of a tiny `family` model with `config` keys added, its masked-LM class)."""
    import transformers

    if family == "eurobert":
        keys = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=PAD_ID,
                    bos_token_id=1, eos_token_id=2, mask_token_id=3,
                    rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        keys.update(config)
        return transformers.EuroBertConfig(**keys), transformers.EuroBertForMaskedLM
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, initializer_range=0.2, pad_token_id=PAD_ID, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if family == "gte":
        keys = dict(common, type_vocab_size=1, rope_parameters={"rope_type": "default", "rope_theta": 700.0})
        keys.update(config)
        return transformers.GteConfig(**keys), transformers.GteForMaskedLM
    if family == "nomic_bert":
        keys = dict(common, type_vocab_size=2, rope_parameters={"rope_type": "default", "rope_theta": 300.0})
        keys.update(config)
        return transformers.NomicBertConfig(**keys), transformers.NomicBertForMaskedLM
    if family == "ultrabert":
        # 4 layers: sliding, sliding, full, sliding (transformers' default pattern; 2 per pipeline
        # stage); a window of 3 each side, shorter than the rows; a head narrower than the hidden size.
        keys = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=PAD_ID,
                    sliding_window=3, prediction_head_size=24,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 900.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})
        keys.update(config)
        return transformers.UltrabertConfig(**keys), transformers.UltrabertForMaskedLM
    raise ValueError(family)


def make_family_dir(path, family: str, **config) -> str:
    """transformers' masked LM of `family` with `config` keys added or replaced, norm weights
    (and biases) moved off their init so that a swapped name would show; saved to `path`."""
    cfg, cls = family_config(family, **config)
    return save_perturbed(cls, cfg, path)

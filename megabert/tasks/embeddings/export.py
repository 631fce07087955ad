"""The fine-tuned bi-encoder as a sentence-transformers model directory:

    sentence-transformers/
      config.json, model.safetensors      transformers' BertModel (the encoder alone)
      vocab.txt, tokenizer_config.json    its BertTokenizer (megabert's WordPiece, same casing)
      modules.json                        Transformer -> Pooling (-> Normalize)
      sentence_bert_config.json           max_seq_length (texts cut as megabert cuts them)
      1_Pooling/config.json               mean or [CLS] pooling
      2_Normalize/                        when embeddings are normalised
      config_sentence_transformers.json   the similarity: cosine, or dot without normalisation; the
                                          prompts `query` and `document` (--query-prompt, --document-prompt)

Another family's bi-encoder writes its transformers base model (ModernBertModel, GteModel, ...)
and, when the run's tokenizer is a tokenizer.json, copies tokenizer.json, tokenizer_config.json
and special_tokens_map.json from its directory in place of the WordPiece files.

`SentenceTransformer(dir).encode(texts)` then computes megabert's embeddings (documents';
`encode(queries, prompt_name="query")` or `encode_query` the queries'; max_seq_length is the
documents' length). A Matryoshka model loads truncated as
`SentenceTransformer(dir, truncate_dim=256)` (its cosine similarity re-normalises). The files
are the layout sentence-transformers has written since v2 (and the hub's models use),
which later versions still load.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from megabert.checkpoint import hf as hf_io
from megabert.errors import CheckpointError
from megabert.families import get_family
from megabert.model.pretrained import gather_full
from megabert.parallel import ParallelState, comm
from megabert.model_classes import reference_table
from megabert.parallel.param_spec import spec_table
from megabert.tasks.embeddings.model import BertForSentenceEmbedding


def gather_whole_model(model: BertForSentenceEmbedding, local: Optional[dict] = None) -> Optional[dict]:
    """The full (TP-merged, every pipeline stage's) state dict on rank 0, None elsewhere.
    `local`: this rank's weights as the training run holds them (its checkpoint's model part:
    ZeRO-3 gathers its partitions there), else the model's own parameters. Collective over
    the world."""
    ps: ParallelState = model.parallel_state
    table = spec_table(model)
    named = dict(model.named_parameters()) if local is None else local
    full = gather_full({k: named[k] for k in table}, ps, table)  # collective over TP
    if ps.pp_size > 1 and ps.tp_rank == 0 and ps.dp_rank == 0:
        stages: list = [None] * ps.pp_size
        comm.all_gather_object(stages, full, group=ps.pp_group)  # the stages of (tp 0, dp 0): rank 0's group
        full = {k: v for stage in stages for k, v in stage.items()}
    return full if ps.rank == 0 else None


def write_sentence_transformers(path: str, model: BertForSentenceEmbedding, full: dict, vocab_file: str, *,
                                lower_case: bool, max_seq_length: int, prompts: Optional[dict] = None) -> None:
    """Writes the directory from rank 0's gathered state (gather_whole_model)."""
    table = reference_table(model.config, type(model).__name__)
    family = get_family(model.config.model_family)
    # transformers' base model (BertModel, ModernBertModel) is the masked LM's without the prefix.
    hf_state = {k.removeprefix(family.hf_base_prefix): v for k, v in hf_io.megabert_to_hf(full, table).items()}
    config = hf_io.hf_config_from_model(model.config, family.architectures["embeddings"])
    # The run's tokenizer travels: a tokenizer.json (any family's: NomicBERT's may be one) or WordPiece.
    if family.recipe.tokenizer == "tokenizer.json" or vocab_file.endswith(".json"):
        hf_io.write_hf_dir(path, hf_state, config)
        copy_tokenizer_json(vocab_file, path)
    else:
        hf_io.write_hf_dir(path, hf_state, config, vocab_file, lower_case=lower_case)
    options = model.options
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if options.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    pooling = {"word_embedding_dimension": model.config.hidden_size,
               "pooling_mode_cls_token": options.pooling == "cls",
               "pooling_mode_mean_tokens": options.pooling == "mean",
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    files = {"modules.json": modules, "1_Pooling/config.json": pooling,
             "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
             "config_sentence_transformers.json": {"similarity_fn_name": "cosine" if options.normalize else "dot",
                                                   "prompts": dict(prompts or {}), "default_prompt_name": None}}
    for name, value in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)


# What transformers' AutoTokenizer reads from a ModernBERT dir (tokenizer.json holds the model).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_json(vocab_file: str, path: str) -> None:
    """The run's tokenizer.json and the config files beside it, readable by every user."""
    source = os.path.dirname(os.path.abspath(vocab_file))
    if not vocab_file.endswith(".json") or not os.path.isfile(vocab_file):
        raise CheckpointError(f"--vocab-file {vocab_file} is not a tokenizer.json; the ModernBERT export copies "
                              f"the tokenizer.json the model was trained with")
    for name in TOKENIZER_JSON_FILES:
        src = vocab_file if name == "tokenizer.json" else os.path.join(source, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(path, name))
            os.chmod(os.path.join(path, name), 0o644)

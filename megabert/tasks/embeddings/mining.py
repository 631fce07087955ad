"""Hard negatives mined with a model (tools/mine_hard_negatives.py): for each training pair's
query, the corpus passages the model ranks highest that are not its positives, chosen with
sentence-transformers' `mine_hard_negatives` semantics (sampling "top"):

- the corpus is --corpus (a BEIR corpus.jsonl: title + " " + text) or the pairs' positives,
  with every positive added and duplicates dropped; a query that repeats has the positives of
  all its pairs;
- scores are cosine similarities (the embeddings normalised, whatever the model's option);
- each query's top range_max + (most positives of a query) passages are the candidates; its
  positives are removed; with --relative-margin M a candidate above
  (lowest positive score) - |lowest positive score| x M is removed, with --absolute-margin A
  one above (lowest positive score) - A, with --max-score S one above S;
- the survivors ranked range_min .. range_max - 1 are kept, the first --num-negatives of them.
  range_max defaults to range_min + num_negatives + most positives, or with a margin or a
  maximum score range_min + 10 x num_negatives + most positives.

The corpus is embedded in batches, sharded over the data-parallel ranks (tensor- and
pipeline-parallel models as in training), with a progress bar on rank 0; each rank takes the
exact top-k of every query over its shard on the device (or with faiss' exact inner-product
index, --faiss), and rank 0 merges the shards' candidates: the top-k of the whole corpus.
The output is the pairs, in their order, each with a `negative` list (fewer than
--num-negatives where too few passed the filters) that finetune_embeddings.py --train-file
reads; a pair's own negatives are replaced.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megabert.arguments import Cli
from megabert.config import FinetuneConfigs
from megabert.config_fields import arg, check_at_least
from megabert.errors import ConfigError
from megabert.parallel import ParallelState, comm
from megabert.tasks.embeddings.config import TextEmbeddingConfig
from megabert.tasks.embeddings.data import Pair, read_corpus, read_pairs
from megabert.tasks.embeddings.features import TextFormat
from megabert.tasks.embeddings.finetuning import load_embedding_model
from megabert.training.finetune import FinetuneTask, Predictor
from megabert.training.strategy import TrainingTask

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class MiningConfig(TextEmbeddingConfig):
    """Hard-negative mining: the pairs, the corpus, the output and sentence-transformers' filters."""

    pairs: Optional[str] = arg(None, "JSON lines {\"query\": .., \"positive\": ..}: the pairs to mine negatives for.")
    corpus: Optional[str] = arg(None, "A BEIR corpus.jsonl (_id, title, text) to mine from; default the pairs' "
                                "positives.")
    output: Optional[str] = arg(None, "Where the pairs go, each with a \"negative\" list.")
    num_negatives: int = arg(3, "Negatives per pair.")
    range_min: int = arg(0, "Skip the query's top this many candidates (after its positives are removed).")
    range_max: Optional[int] = arg(None, "Consider the query's top this many candidates; default range_min + "
                                   "num_negatives + most positives (x10 negatives with a margin or --max-score).")
    max_score: Optional[float] = arg(None, "Remove candidates whose similarity to the query is above this.")
    relative_margin: Optional[float] = arg(None, "Remove candidates scoring above the positive's score minus M x its "
                                           "magnitude (0.05: NV-Retriever's TopK-PercPos 95%%).")
    absolute_margin: Optional[float] = arg(None, "Remove candidates scoring above the positive's score minus this.")
    faiss: bool = arg(False, "Search with faiss' exact inner-product index (IndexFlatIP; faiss must be installed) "
                      "instead of a matrix product on the device.")
    search_batch_size: int = arg(16384, "Queries scored against the corpus at a time (a [batch, corpus shard] "
                                 "matrix).")

    def __post_init__(self):
        super().__post_init__()
        if not self.pairs or not self.output:
            raise ConfigError("--pairs and --output are required")
        check_at_least(self, 0, "range_min")
        check_at_least(self, 1, "num_negatives", "range_max", "search_batch_size")


@dataclass(frozen=True)
class MiningSet:
    """The unique queries, the corpus (unique texts) and each query's positives in it."""

    pairs: list[Pair]
    queries: list[str]
    corpus: list[str]
    positives: list[list[int]]  # per query, corpus indices

    @classmethod
    def build(cls, pairs: list[Pair], corpus: Optional[list[str]]) -> "MiningSet":
        texts = list(dict.fromkeys((corpus or []) + [p.positive for p in pairs]))
        where = {t: i for i, t in enumerate(texts)}
        queries = list(dict.fromkeys(p.query for p in pairs))
        index = {q: i for i, q in enumerate(queries)}
        positives: list[list[int]] = [[] for _ in queries]
        for p in pairs:
            if where[p.positive] not in positives[index[p.query]]:
                positives[index[p.query]].append(where[p.positive])
        return cls(pairs, queries, texts, positives)


def candidate_count(cfg: MiningConfig, most_positives: int) -> tuple[int, int]:
    """(range_max, candidates per query) as sentence-transformers derives them."""
    range_max = cfg.range_max
    if range_max is None:
        filtered = cfg.relative_margin is not None or cfg.absolute_margin is not None or cfg.max_score is not None
        range_max = cfg.range_min + cfg.num_negatives * (10 if filtered else 1) + most_positives
    if cfg.range_min >= range_max:
        raise ConfigError(f"--range-min {cfg.range_min} must be below --range-max {range_max}")
    if cfg.num_negatives > range_max - cfg.range_min:
        raise ConfigError(f"--num-negatives {cfg.num_negatives}: only {range_max - cfg.range_min} candidates between "
                          f"--range-min {cfg.range_min} and --range-max {range_max}; lower it or raise --range-max")
    return range_max, range_max + most_positives


def select_negatives(scores: torch.Tensor, indices: torch.Tensor, positives: list[list[int]],
                     positive_scores: list[torch.Tensor], cfg: MiningConfig, range_max: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores, indices [queries, candidates] (each query's best, descending; index -1 pads a
    small corpus) -> (indices, scores) [queries, num_negatives] of the chosen negatives, a
    score of -inf where too few candidates passed."""
    scores = scores.clone()
    scores[indices == -1] = -float("inf")
    for q, pos in enumerate(positives):
        scores[q, torch.isin(indices[q], torch.tensor(pos, device=indices.device))] = -float("inf")
    # The margins are taken from the query's lowest-scoring (hardest) positive.
    lowest = torch.stack([s.min() for s in positive_scores]).to(scores.dtype).unsqueeze(1)
    if cfg.absolute_margin is not None:
        scores[scores + cfg.absolute_margin > lowest.expand_as(scores)] = -float("inf")
    if cfg.relative_margin is not None:
        # |positive| x margin, not x (1 - margin): the same for negative scores (sentence-transformers #3819).
        scores[scores > (lowest - lowest.abs() * cfg.relative_margin).expand_as(scores)] = -float("inf")
    if cfg.max_score is not None:
        scores[scores > cfg.max_score] = -float("inf")
    top, local = torch.topk(scores, k=range_max, dim=1)
    chosen = indices.gather(1, local)
    keep = slice(cfg.range_min, cfg.range_min + cfg.num_negatives)
    return chosen[:, keep], top[:, keep]


def shard_top_k(queries: torch.Tensor, shard: torch.Tensor, offset: int, k: int, block: int, use_faiss: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top k (scores, corpus indices) [queries, k] of every query over one corpus
    shard (rows offset ..), padded with (-inf, -1) where the shard has fewer than k."""
    n = shard.size(0)
    kk = min(k, n)
    if use_faiss and n:
        import faiss

        index = faiss.IndexFlatIP(shard.size(1))
        index.add(shard.float().cpu().numpy())
        s, i = index.search(queries.float().cpu().numpy(), kk)
        scores, idx = torch.from_numpy(s).to(queries.device), torch.from_numpy(i).to(queries.device) + offset
    elif n:
        parts = [torch.topk(queries[j:j + block] @ shard.t(), k=kk, dim=1) for j in range(0, len(queries), block)]
        scores = torch.cat([p.values for p in parts])
        idx = torch.cat([p.indices for p in parts]) + offset
    else:
        scores = queries.new_zeros((len(queries), 0))
        idx = torch.zeros((len(queries), 0), dtype=torch.long, device=queries.device)
    pad = k - scores.size(1)
    if pad:
        scores = torch.cat([scores, scores.new_full((len(queries), pad), -float("inf"))], dim=1)
        idx = torch.cat([idx, idx.new_full((len(queries), pad), -1)], dim=1)
    return scores, idx


def normalized(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.from_numpy(x).to(device, torch.float32), dim=-1)


class MiningTask(FinetuneTask):
    """Nothing to train: predict() embeds, searches and writes --output."""

    name = "mining"
    cli = Cli(MiningConfig)

    def __init__(self, cfg, pretrained):
        super().__init__(cfg, pretrained)
        self.data: Optional[MiningSet] = None
        self.model = None

    @property
    def training_task(self) -> TrainingTask:
        return TrainingTask(inputs=("input_ids", "token_type_ids", "attention_mask"), output_loss=lambda out: None)

    def check_inputs(self) -> None:
        corpus = read_corpus(self.config.corpus)[1] if self.config.corpus else None
        self.data = MiningSet.build(read_pairs(self.config.pairs), corpus)
        self.range_max, self.k = candidate_count(self.config, max(map(len, self.data.positives)))

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        self.model = load_embedding_model(self.cfg, self.pretrained, ps, vocab_size, texts_per_example=1)
        return self.model

    def train_tensors(self, tokenizer):
        return None

    def predict(self, tokenizer, predictor: Predictor) -> None:
        cfg, data, ps = self.config, self.data, predictor.ps
        fmt = TextFormat.of(cfg)
        device = ps.device
        pick = lambda o: (o.embeddings[:, 0],)  # noqa: E731  [n, h]
        queries = normalized(predictor.outputs(fmt.queries(data.queries, tokenizer), pick)[0], device)
        bar = progress_bar(len(np.array_split(np.arange(len(data.corpus)), ps.dp_size)[ps.dp_rank]), ps.rank == 0)
        mine = predictor.outputs(fmt.documents(data.corpus, tokenizer), pick, gather=False, progress=bar.update)
        bar.close()
        rows = np.array_split(np.arange(len(data.corpus)), ps.dp_size)[ps.dp_rank]
        shard = normalized(mine[0], device) if mine is not None else queries.new_zeros((0, queries.size(1)))
        offset = int(rows[0]) if len(rows) else 0
        scores, idx = shard_top_k(queries, shard, offset, self.k, cfg.search_batch_size, cfg.faiss)
        # Each query's positives' scores, from the shard that holds them.
        local_pos = {(q, i): float(queries[q] @ shard[i - offset]) for q, pos in enumerate(data.positives)
                     for i in pos if offset <= i < offset + shard.size(0)}
        shards = [(scores.cpu(), idx.cpu(), local_pos)]
        if ps.dp_size > 1:
            shards = [None] * ps.dp_size
            comm.all_gather_object(shards, (scores.cpu(), idx.cpu(), local_pos), group=ps.dp_group)
        if not predictor.writes:
            return
        scores = torch.cat([s for s, _, _ in shards], dim=1)
        idx = torch.cat([i for _, i, _ in shards], dim=1)
        top, local = torch.topk(scores, k=self.k, dim=1)  # the whole corpus's top k
        idx = idx.gather(1, local)
        pos_scores = {key: v for _, _, p in shards for key, v in p.items()}
        positive_scores = [torch.tensor([pos_scores[(q, i)] for i in pos]) for q, pos in enumerate(data.positives)]
        chosen, chosen_scores = select_negatives(top, idx, data.positives, positive_scores, cfg, self.range_max)
        self._write(chosen, chosen_scores)

    def _write(self, chosen: torch.Tensor, chosen_scores: torch.Tensor) -> None:
        cfg, data = self.config, self.data
        index = {q: i for i, q in enumerate(data.queries)}
        found = [[data.corpus[i] for i, s in zip(row.tolist(), row_scores.tolist()) if s != -float("inf")]
                 for row, row_scores in zip(chosen, chosen_scores)]
        os.makedirs(os.path.dirname(os.path.abspath(cfg.output)), exist_ok=True)
        with open(cfg.output, "w", encoding="utf-8") as f:
            for p in data.pairs:
                f.write(json.dumps({"query": p.query, "positive": p.positive, "negative": found[index[p.query]]},
                                   ensure_ascii=False) + "\n")
        short = sum(len(n) < cfg.num_negatives for n in found)
        print(f"mined {sum(map(len, found))} negatives for {len(data.queries)} queries ({len(data.pairs)} pairs) from "
              f"{len(data.corpus)} passages -> {cfg.output}"
              + (f"; {short} queries have fewer than {cfg.num_negatives} (loosen --range-max or the filters)"
                 if short else ""), flush=True)


def with_export_defaults(cfg: FinetuneConfigs) -> FinetuneConfigs:
    """--load a sentence-transformers dir (ours, or any BERT / ModernBERT one with mean or
    [CLS] pooling): its pooling, normalisation, prompts (`query`, `document`) and
    max_seq_length, where the command line does not set them."""
    path = cfg.train.load
    modules_file = os.path.join(path, "modules.json") if path and os.path.isdir(path) else ""
    if not os.path.isfile(modules_file):
        return cfg
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    found: dict = {"normalize": any(m.get("type", "").endswith("Normalize") for m in modules)}
    pooling_dir = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")), None)
    if pooling_dir is not None:
        pooling = _json(os.path.join(path, pooling_dir, "config.json"))
        mode = pooling.get("pooling_mode") or ("cls" if pooling.get("pooling_mode_cls_token") else
                                               "mean" if pooling.get("pooling_mode_mean_tokens") else None)
        if mode not in ("cls", "mean"):
            raise ConfigError(f"{path}: pooling {mode!r}; megabert pools by mean or [CLS]")
        found["pooling"] = mode
    prompts = _json(os.path.join(path, "config_sentence_transformers.json")).get("prompts") or {}
    for ours, names in (("query_prompt", ("query",)), ("document_prompt", ("document", "passage", "corpus"))):
        value = next((prompts[n] for n in names if prompts.get(n)), None)
        if value is not None:
            found[ours] = value
    length = _json(os.path.join(path, "sentence_bert_config.json")).get("max_seq_length")
    if length:
        found["max_seq_length"] = int(length)
    typed = {k.split(".", 1)[1] for k in cfg.explicit if k.startswith("finetune.")}
    return dataclasses.replace(cfg, finetune=dataclasses.replace(
        cfg.finetune, **{k: v for k, v in found.items() if k not in typed}))


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def progress_bar(total: int, enabled: bool):
    """tqdm on rank 0 (the corpus shard's passages); a stand-in that counts nothing elsewhere."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="embedding the corpus", unit="passage", disable=not enabled)

"""Typed configuration tree (presets: megabert.presets).

Each field carries its CLI flag (Megatron-LM's name wherever Megatron has the flag) and
its help text in `metadata`; `megabert.arguments` turns these dataclasses into the CLI,
so a flag exists in exactly one place. `__post_init__` checks single fields (a positive
size, a value in range) with a one-line ConfigError naming the flag; rules that relate
several flags are megabert.rules', applied once when the run is resolved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config_fields import arg, check_at_least
from megabert.errors import ConfigError

# --ddp-bucket-size's default, which the reducers (megabert.data_parallel) and the layout
# planner (megabert.planning) read too: 16 MB of fp32 gradients (PyTorch DDP: 25 MB).
# Backward issues a bucket's all-reduce once all its gradients are in, so smaller buckets
# start sooner and leave less unhidden after backward; below a few MB each message's
# latency starts to show. A 12M-parameter BERT makes 3 buckets, BERT-large 81.
BUCKET_ELEMENTS = 4 * 1024 * 1024


# The activations megabert's ModernBERT implements, by transformers' ACT2FN names.
MODERNBERT_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


@dataclass(kw_only=True)
class ModelConfig:
    """The BERT architecture and how its layers compute."""

    num_layers: int = arg(2, "Number of transformer layers.")
    hidden_size: int = arg(128, "Transformer hidden size.")
    num_attention_heads: int = arg(2, "Number of attention heads.")
    ffn_hidden_size: Optional[int] = arg(None, "MLP hidden size; default the family's width for --model-family "
                                         "NAME (megabert.families), else 4 x hidden size.")
    vocab_size: int = arg(30522, "Vocabulary size before padding (taken from the tokenizer when one is given).",
                          cli=False)
    make_vocab_size_divisible_by: int = arg(128, "Pad the vocab to a multiple of this x tensor parallel size.")
    max_position_embeddings: int = arg(512, "Number of position embeddings.")
    type_vocab_size: int = arg(2, "Number of token types (segments).", flag="--num-tokentypes")
    hidden_dropout: float = arg(0.1, "Dropout on hidden states and embeddings.")
    attention_dropout: float = arg(0.1, "Dropout on attention probabilities.")
    layernorm_epsilon: float = arg(1e-12, "LayerNorm epsilon (1e-12 as the original BERT and transformers).")
    init_method_std: float = arg(0.02, "Standard deviation of the normal weight initialisation.")
    layernorm_position: str = arg("post", "post: the original BERT; pre: LayerNorm before each sublayer "
                                  "(more stable for deep models).", choices=("post", "pre"))
    embedding_layernorm: bool = arg(True, "LayerNorm after the embeddings (BERT's, transformers'); "
                                    "--no-embedding-layernorm: none, as Megatron-LM builds BERT.")
    bert_binary_head: bool = arg(True, "Train the sentence-pair (SOP/NSP) head.", cli=False)
    mlm_logits_at_masked_only: bool = arg(False, "Compute MLM logits only at masked positions when labels are "
                                          "given (saves the [tokens, vocab] matmul and memory for unmasked "
                                          "tokens); on by default in pretrain_bert.py.")
    unpad_input: bool = arg(False, "Run the encoder's token-wise work (GEMMs, GELU, LayerNorm, dropout) on "
                            "real tokens only, leaving padding out (NVIDIA's unpadded BERT); the pre-training "
                            "loss is unchanged. On by default in pretrain_bert.py; needs a [b, s] padding mask "
                            "and no --sequence-parallel.")
    attention_backend: str = arg("auto", "Core attention: torch (unfused reference), sdpa "
                                 "(torch scaled_dot_product_attention), fused (megabert softmax kernel), "
                                 "varlen (real tokens only with --unpad-input: megabert's CPU kernel; "
                                 "FlashAttention's varlen kernel on CUDA in fp16/bf16, one padded SDPA call "
                                 "in fp32), auto (varlen on CPU when built for AVX2/AVX-512 and on CUDA "
                                 "with FlashAttention, else sdpa).",
                                 choices=("auto", "torch", "sdpa", "fused", "varlen"))
    layernorm_backend: str = arg("auto", "LayerNorm: torch, fused (megabert kernel), auto (fused on CPU when "
                                 "built, else torch).", choices=("auto", "torch", "fused"))
    dropout_add_backend: str = arg("auto", "The layers' GEMM epilogues (hidden dropout + residual add "
                                   "(+ post-LN LayerNorm), bias + GELU, a gated MLP's act(input) * gate, "
                                   "RoPE on the QKV output): torch (PyTorch's op chain), fused (megabert CPU kernels: dropout + "
                                   "add with a Philox mask, one pass; the gated activation and RoPE (with the "
                                   "grouped-query head layout), one pass each way), compiled "
                                   "(each epilogue one torch.compile'd function), auto (fused on CPU when built, "
                                   "else torch: on CUDA the chain measured faster than compiled).",
                                   choices=("auto", "torch", "fused", "compiled"))
    recompute_granularity: Optional[str] = arg(None, "Activation recompute: full (whole layers) or "
                                               "selective (attention core only).", choices=(None, "full", "selective"))
    sequence_parallel: bool = arg(False, "Shard LayerNorm/dropout activations along the sequence over the "
                                  "tensor-parallel group (needs --tensor-model-parallel-size > 1 to matter).")
    bf16_residual: bool = arg(False, "With --bf16: the residual stream, the LayerNorms' inputs, outputs and "
                              "parameters and the linear layers' biases in bf16 (fp32 maths inside each LayerNorm, "
                              "fp32 masters in the optimizer), Megatron-LM's bf16 default. Without it the residual "
                              "stream is fp32 (autocast's): twice the bytes in every pass between the GEMMs.")
    # Sequence and token classification heads (GLUE, NER), as transformers' BertConfig keeps them:
    # set by the task from its label set, saved with the checkpoint, exported to config.json.
    num_labels: int = arg(2, "Outputs of a classification head; 1 is regression (STS-B).", cli=False)
    id2label: Optional[dict] = arg(None, "Class id -> label name (tag) of a classification head.", cli=False)
    # The model family (megabert.families: the registry knows each family's names, parts and
    # defaults; this module sits below it). The fields marked "ModernBERT:" below are named as
    # transformers' ModernBertConfig names them and read by the families whose spec uses them.
    model_family: str = arg("bert", "Model family, a name in megabert.families' registry: the encoder's parts, and "
                            "its recipe for the flags left out (mask rate, binary head, dropout, norm eps, MLP width, "
                            "positions).")
    num_query_groups: Optional[int] = arg(None, "Key/value heads (grouped-query attention; query heads "
                                          "[j*g, (j+1)*g) share head j); default: one per attention head. "
                                          "Families with GQA (eurobert, ultrabert).")
    kv_channels: Optional[int] = arg(None, "Each attention head's dimension; default hidden size / heads.")
    layer_types: Optional[list] = arg(None, "Each layer's attention, full_attention or sliding_attention (UltraBERT's "
                                      "config.json); None: the family's pattern.", cli=False)
    prediction_head_size: Optional[int] = arg(None, "UltraBERT: the MLM head's bottleneck width (default hidden size).")
    untie_embeddings_and_output_weights: bool = arg(False, "The MLM decoder has a weight of its own instead of the "
                                                    "word embeddings (EuroBERT's default).")
    global_rope_theta: float = arg(160000.0, "ModernBERT: RoPE base of the global attention layers.")
    local_rope_theta: float = arg(10000.0, "ModernBERT: RoPE base of the local (sliding window) attention layers.")
    global_attn_every_n_layers: int = arg(3, "ModernBERT: layer i attends globally when i %% n == 0, else "
                                          "locally.")
    local_attention: int = arg(128, "ModernBERT: the local layers' window (a token sees the tokens at most "
                               "local_attention // 2 positions away, as transformers).")
    norm_bias: bool = arg(False, "ModernBERT: LayerNorms with a bias.")
    attention_bias: bool = arg(False, "ModernBERT: biases in Wqkv and the attention's Wo.")
    mlp_bias: bool = arg(False, "ModernBERT: biases in the MLP's Wi and Wo.")
    decoder_bias: bool = arg(True, "ModernBERT: a bias in the MLM decoder (tied to the word embeddings).")
    classifier_bias: bool = arg(False, "ModernBERT: a bias in the MLM head's dense layer and in classifiers.")
    hidden_activation: str = arg("gelu", "ModernBERT: the GeGLU's activation (transformers' ACT2FN name).",
                                 choices=MODERNBERT_ACTIVATIONS)
    classifier_activation: str = arg("gelu", "ModernBERT: the MLM head's (and classifiers') activation.",
                                     choices=MODERNBERT_ACTIVATIONS)
    initializer_cutoff_factor: float = arg(2.0, "ModernBERT: weights are drawn from a normal truncated at this "
                                           "many standard deviations.")
    embedding_dropout: float = arg(0.0, "ModernBERT: dropout after the embedding LayerNorm.")
    mlp_dropout: float = arg(0.0, "ModernBERT: dropout inside the MLP (after the GeGLU).")
    classifier_pooling: str = arg("cls", "ModernBERT: classifiers pool the [CLS] token or the mean of the tokens.",
                                  choices=("cls", "mean"))
    classifier_dropout: float = arg(0.0, "ModernBERT: dropout before a classifier.")
    special_token_ids: Optional[dict] = arg(None, "ModernBERT: config.json's pad/bos/eos/cls/sep token ids, kept "
                                            "for export.", cli=False)

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            # The transformer's (and Megatron's) width. A family's own (--model-family NAME) is
            # the registry's, applied where the run is resolved (megabert.families.scratch_config).
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "max_position_embeddings", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("hidden_dropout", "attention_dropout", "embedding_dropout", "mlp_dropout", "classifier_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        check_at_least(self, 1, "global_attn_every_n_layers")
        if self.local_attention < 2 or self.local_attention % 2:
            raise ConfigError(f"--local-attention must be an even window of at least 2 tokens, got "
                              f"{self.local_attention}")
        if self.num_labels < 1:
            raise ConfigError(f"num_labels must be >= 1 (1: regression), got {self.num_labels}")
        if self.id2label is not None:
            # Keys as ints whatever wrote them (JSON, a Hugging Face config.json, has strings).
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
            if sorted(self.id2label) != list(range(self.num_labels)):
                raise ConfigError(f"id2label {self.id2label} does not name classes 0..{self.num_labels - 1}")

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def is_global_layer(self, layer: int) -> bool:
        """ModernBERT: whether layer `layer` (0-based) attends globally (transformers' layer_types)."""
        return layer % self.global_attn_every_n_layers == 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule),
        so every TP rank holds an equal, GEMM-friendly slice."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return ((self.vocab_size + multiple - 1) // multiple) * multiple


@dataclass(kw_only=True)
class ParallelConfig:
    """How ranks are laid out: TP ranks adjacent, then DP, then PP."""

    tensor_model_parallel_size: int = arg(1, "Tensor (intra-layer) model parallel size.")
    pipeline_model_parallel_size: int = arg(1, "Pipeline (inter-layer) model parallel size.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(
        None, "Layers per virtual stage for the interleaved 1F1B schedule.")
    decoder_first_pipeline_num_layers: Optional[int] = arg(
        None, "Layers of the first pipeline stage (Megatron's flag; it also holds the embeddings); the stages "
              "without a count of their own share the rest evenly.")
    decoder_last_pipeline_num_layers: Optional[int] = arg(
        None, "Layers of the last pipeline stage (Megatron's flag; it also holds the heads); the stages without a "
              "count of their own share the rest evenly.")
    distributed_backend: Optional[str] = arg(None, "Process group backend; default nccl on GPU, gloo on CPU.",
                                             choices=(None, "nccl", "gloo"))
    distributed_timeout_minutes: float = arg(10.0, "How long any process group megabert makes waits for a peer: "
                                             "a rank that stops or a dropped link then ends every rank with one "
                                             "line instead of hanging the job.")
    overlap_grad_reduce: bool = arg(True, "Average data-parallel gradients bucket by bucket while backward still "
                                    "runs (--no-overlap-grad-reduce: all at once after it). DeepSpeed runs use "
                                    "DeepSpeed's own overlap_comm.")
    ddp_bucket_size: int = arg(BUCKET_ELEMENTS, "Elements per data-parallel gradient bucket: smaller buckets start "
                               "reducing earlier in backward, larger ones send fewer messages.")
    use_distributed_optimizer: bool = arg(False, "Shard the optimizer states over data parallelism (megabert's own "
                                          "ZeRO-1, Megatron's distributed optimizer): gradient buckets are "
                                          "reduce-scattered, each rank steps its shard, parameters are all-gathered.")
    overlap_param_gather: bool = arg(True, "With --use-distributed-optimizer: each parameter bucket's all-gather "
                                     "is waited for only by the forward that needs it (--no-overlap-param-gather: "
                                     "all at once after the optimizer step).")

    def __post_init__(self):
        check_at_least(self, 1, "tensor_model_parallel_size", "pipeline_model_parallel_size")
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError("--distributed-timeout-minutes must be positive")
        if self.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size {self.ddp_bucket_size} must be >= 1 (elements per bucket)")


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how they are built."""

    data_path: list = arg(help="Dataset prefix (P for P.bin/P.idx) or weighted prefixes: 0.3 A 0.7 B; or NVIDIA "
                               "DeepLearningExamples .hdf5 / LDDL .parquet shards: a directory, glob or files.",
                          factory=list)
    split: str = arg("969,30,1", "Train,valid,test proportions, e.g. 949,50,1.")
    vocab_file: Optional[str] = arg(None, "WordPiece vocab.txt (or a SentencePiece model / tokenizer.json; "
                                    "--tokenizer-model is the same flag).", aliases=("--tokenizer-model",))
    tokenizer_type: str = arg("BertWordPieceLowerCase", "Tokenizer type.",
                              choices=("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                                       "HuggingFaceTokenizer"))
    seq_length: int = arg(128, "Sequence length of a sample.")
    mask_prob: float = arg(0.15, "Fraction of tokens chosen for masked-LM prediction (the family's default: "
                           "BERT 0.15, ModernBERT 0.3); with --mask-prob-schedule, the rate before its first "
                           "iteration and of validation samples.")
    mask_prob_schedule: Optional[str] = arg(None, "Masking rate over training as ITER:P pairs, e.g. "
                                            "0:0.3,10000:0.15,20000:0.05 (mmBERT's annealing): each P in force from "
                                            "its iteration on (sample ITER x --global-batch-size on), --mask-prob "
                                            "before the first.")
    short_seq_prob: float = arg(0.1, "Probability of a sample shorter than --seq-length.")
    whole_word_masking: bool = arg(False, "Mask all WordPieces of a word together.")
    max_predictions_per_seq: Optional[int] = arg(None, "Cap on masked positions per sample; default "
                                                 "round(--mask-prob x --seq-length).")
    binary_head_task: str = arg("sop", "Sentence-pair objective of the binary head.", choices=("sop", "nsp"))
    num_workers: int = arg(2, "DataLoader worker processes.")
    data_cache_path: Optional[str] = arg(None, "Where sample-mapping caches go (default: next to the data).")
    pack_sequences: bool = arg(False, "Fill each row of --seq-length with whole samples (first-fit decreasing over "
                                      "--packing-window samples; attention stays inside each sample): "
                                      "--micro-batch-size and --global-batch-size then count rows, and a step "
                                      "consumes the samples of its rows.")
    max_samples_per_row: int = arg(3, "With --pack-sequences: the most samples one row holds (MLPerf's BERT packs "
                                      "up to 3).")
    packing_window: int = arg(1024, "With --pack-sequences: how many consecutive samples are packed together (a "
                                    "larger window packs tighter; every data-parallel rank builds every sample of "
                                    "a window, since their lengths decide the rows).")

    def __post_init__(self):
        check_at_least(self, 1, "max_samples_per_row", "packing_window", "max_predictions_per_seq")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        mask_prob_points(self.mask_prob_schedule)  # checked here, read where samples are made
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ConfigError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.seq_length < 8:
            raise ConfigError(f"--seq-length must be at least 8, got {self.seq_length}")
        try:
            parts = [float(x) for x in self.split.replace("/", ",").split(",")]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers such as 949,50,1, got {self.split!r}")
        if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
            raise ConfigError(f"--split must be up to three non-negative numbers with a positive sum, "
                              f"got {self.split!r}")

    @property
    def highest_mask_prob(self) -> float:
        """The highest masking rate of the run: what sizes the masked positions a sample or a
        packed row may hold."""
        return max([self.mask_prob] + [p for _, p in mask_prob_points(self.mask_prob_schedule)])


def mask_prob_points(schedule: Optional[str]) -> tuple[tuple[int, float], ...]:
    """--mask-prob-schedule "0:0.3,10000:0.15" -> ((0, 0.3), (10000, 0.15)); None -> ()."""
    if schedule is None:
        return ()
    points = []
    for item in schedule.split(","):
        it, sep, p = item.strip().partition(":")
        try:
            point = (int(it), float(p))
        except ValueError:
            point = None
        if not sep or point is None:
            raise ConfigError(f"--mask-prob-schedule {schedule!r}: {item.strip()!r} is not ITER:P; give "
                              f"comma-separated pairs such as 0:0.3,10000:0.15")
        if point[0] < 0 or not 0.0 < point[1] < 1.0:
            raise ConfigError(f"--mask-prob-schedule {schedule!r}: {item.strip()!r} needs an iteration >= 0 and a "
                              f"rate in (0, 1)")
        if points and point[0] <= points[-1][0]:
            raise ConfigError(f"--mask-prob-schedule {schedule!r}: iteration {point[0]} comes after "
                              f"{points[-1][0]}; list the iterations in increasing order, each once")
        points.append(point)
    return tuple(points)


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer, learning-rate schedule and loss scaling."""

    optimizer: str = arg("adam", "adam (AdamW, decoupled weight decay) or lamb.", choices=("adam", "lamb"))
    lr: float = arg(1e-4, "Peak learning rate.")
    min_lr: float = arg(0.0, "Learning rate at the end of decay.")
    lr_warmup_iters: int = arg(0, "Linear warmup iterations.")
    lr_warmup_fraction: Optional[float] = arg(None, "Warmup as a fraction of --lr-decay-iters (overrides iters).")
    lr_decay_iters: Optional[int] = arg(None, "Iterations to decay over; default --train-iters.")
    lr_decay_style: str = arg("linear", "Decay after warmup. WSD (warmup-stable-decay, Megatron's; ModernBERT's "
                              "trapezoidal schedule): --lr until the last --lr-wsd-decay-iters of --lr-decay-iters, "
                              "then down to --min-lr as --lr-wsd-decay-style says.",
                              choices=("constant", "linear", "cosine", "polynomial", "warmup_exp_decay_exp", "WSD"))
    lr_wsd_decay_style: str = arg("exponential", "WSD: the shape of the final decay (Megatron's choices; "
                                  "ModernBERT decays as minus_sqrt, 1 - sqrt(t)).",
                                  choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: Optional[int] = arg(None, "WSD: iterations of the final decay (needed with "
                                            "--lr-decay-style WSD).")
    lr_decay_power: float = arg(0.5, "Power of the polynomial decay (NVIDIA's LAMB recipe uses 0.5).")
    lr_exp_decay_rate: float = arg(0.99, "warmup_exp_decay_exp: factor applied every --lr-exp-decay-iters.")
    lr_exp_decay_iters: int = arg(1000, "warmup_exp_decay_exp: iterations per decay factor.")
    weight_decay: float = arg(0.01, "Decoupled weight decay (not applied to biases and LayerNorm).")
    adam_beta1: float = arg(0.9, "First-moment decay.")
    adam_beta2: float = arg(0.999, "Second-moment decay.")
    adam_eps: float = arg(1e-6, "Denominator epsilon (1e-6 as the original BERT).")
    clip_grad: float = arg(1.0, "Clip the global gradient norm to this value (0 disables).")
    loss_scale: Optional[float] = arg(None, "Static fp16 loss scale; default dynamic.")
    initial_loss_scale: float = arg(2.0 ** 32, "Initial dynamic fp16 loss scale.")
    min_loss_scale: float = arg(1.0, "Dynamic loss scale floor.")
    loss_scale_window: int = arg(1000, "Steps without overflow before the scale doubles.")
    hysteresis: int = arg(2, "Overflows tolerated before the scale halves.")
    bias_correction: bool = arg(True, "Adam/LAMB bias correction of the moment estimates; --no-bias-correction "
                                "as the DeepSpeed BERT recipe (bias_correction false).")
    lamb_min_coeff: float = arg(0.01, "LAMB: lower bound of the trust ratio ||w|| / ||update|| (DeepSpeed's "
                                "min_coeff).")
    lamb_max_coeff: float = arg(10.0, "LAMB: upper bound of the trust ratio (DeepSpeed's max_coeff; its BERT "
                                "tutorial uses 0.3).")
    lr_warmup_init: float = arg(0.0, "Learning rate the warmup starts from, rising linearly to --lr (Megatron's "
                                "flag); with warmup_exp_decay_exp, bing_bert's --lr_offset (an offset kept "
                                "through the decay, --lr being the peak including it).")

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction <= 1.0:
            raise ConfigError("--lr-warmup-fraction must be in [0, 1]")
        if self.clip_grad < 0:
            raise ConfigError("--clip-grad must be >= 0")
        if self.lr_decay_style == "WSD" and (self.lr_wsd_decay_iters is None or self.lr_wsd_decay_iters < 1):
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N >= 1 (the iterations of the final "
                              "decay)")


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop: batch sizes, precision, checkpoints, logging, DeepSpeed."""

    micro_batch_size: int = arg(8, "Samples per forward pass on one data-parallel rank.")
    global_batch_size: Optional[int] = arg(None, "Samples per optimizer step over all ranks; default "
                                           "micro batch x data-parallel size (no accumulation).")
    train_iters: int = arg(100, "Total optimizer steps, counted from the start of training.")
    seed: int = arg(1234, "Random seed for initialisation, dropout and data.")
    bf16: bool = arg(False, "bfloat16 mixed precision.")
    fp16: bool = arg(False, "float16 mixed precision with loss scaling.")
    save: Optional[str] = arg(None, "Checkpoint directory to save to.")
    load: Optional[str] = arg(None, "Checkpoint (megabert or Hugging Face) to start from.")
    save_interval: Optional[int] = arg(None, "Save every this many iterations.")
    exit_interval: Optional[int] = arg(None, "Save (with --save) and exit when the iteration is a multiple of this.")
    finetune: bool = arg(False, "With --load: take the weights only; iteration, optimizer and data start afresh.")
    load_optim: bool = arg(True, "With --load: restore the optimizer state; --no-load-optim starts the optimizer "
                           "afresh while the weights, iteration and data position continue (Megatron's flag).")
    pretrained_checkpoint: Optional[str] = arg(
        None, "Start from this checkpoint's weights (megabert, Hugging Face or Google TF BERT dir; iteration, "
        "optimizer and data start afresh, as --finetune) only while the run has no checkpoint of its own in --load "
        "(--save when --load is not given); once it has, a restart resumes that one. Megatron-LM's flag: "
        "phase 2 of two-phase pre-training, restart-safe.")
    keep_last_checkpoints: Optional[int] = arg(None, "Keep only the newest N checkpoints.")
    eval_interval: int = arg(1000, "Evaluate on the valid split every this many iterations.")
    eval_iters: int = arg(10, "Batches per evaluation.")
    log_interval: int = arg(10, "Log every this many iterations.")
    metrics_file: Optional[str] = arg(None, "Append one JSON object per logged iteration to this file.")
    tensorboard_dir: Optional[str] = arg(None, "Write TensorBoard scalars here.")
    deepspeed: bool = arg(False, "Train with DeepSpeed (ZeRO over the data-parallel group).")
    deepspeed_config: Optional[str] = arg(None, "DeepSpeed JSON; default built from these flags.",
                                          flag="--deepspeed_config")
    zero_stage: int = arg(0, "ZeRO stage with --deepspeed.", choices=(0, 1, 2, 3))
    zero_offload_optimizer: str = arg("none", "ZeRO-Offload: keep optimizer states and the update on the CPU "
                                      "(torch's fused AdamW on the CPU partitions; needs --zero-stage 1-3).",
                                      choices=("none", "cpu"))
    zero_offload_params: str = arg("none", "ZeRO-Infinity: keep partitioned parameters in CPU memory between "
                                   "uses (needs --zero-stage 3).", choices=("none", "cpu"))
    compile: bool = arg(False, "torch.compile each transformer layer (TorchInductor; the fused kernels enter the "
                        "graph as custom ops, dropout draws eager mode's masks): the losses of eager mode to ~1e-5 in "
                        "fp32, after a one-off compilation at the first training step and the first evaluation. "
                        "Combines with tensor, sequence and pipeline parallelism, activation recompute and "
                        "ZeRO-1/2, not ZeRO-3. At TP=1 each layer is one graph; with TP > 1 attention dropout "
                        "(drawn from the per-TP-rank RNG stream) runs eagerly between compiled graphs.")
    cuda_graphs: bool = arg(False, "Capture each packed micro-batch's forward, loss and backward as one CUDA graph "
                            "after 3 eager steps and replay it for every later one (torch.cuda.graph): the host "
                            "launches one graph instead of thousands of kernels. Needs a GPU, --pack-sequences "
                            "(fixed shapes), bf16 or fp32, TP=1 and PP=1, no recompute, no DeepSpeed and not "
                            "--use-distributed-optimizer; the data-parallel average then runs after backward. "
                            "Combines with --compile (the compiled layers are captured with the rest). The losses "
                            "and dropout masks are eager mode's.")
    memory_budget_gb: Optional[float] = arg(None, "Per-rank memory budget in GB (1e9 bytes): before the model is "
                                            "built, the layout planner's predicted peak is checked against it and "
                                            "a layout that exceeds it is named with the flags that would make it "
                                            "fit. Default: the GPU's total memory on CUDA; no check on CPU, where "
                                            "a budget is compared with the peak resident set size.")

    def __post_init__(self):
        check_at_least(self, 1, "micro_batch_size")
        check_at_least(self, 0, "train_iters")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ConfigError(f"--memory-budget-gb must be a positive number of GB per rank, "
                              f"got {self.memory_budget_gb}")


@dataclass
class Configs:
    """pretrain_bert.py's configs. `explicit` holds the "section.field" names the user set on
    the command line, so a merge with another source (a DeepSpeed JSON) can tell a flag
    that was given from one left at its default."""
    model: ModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optim: OptimConfig
    train: TrainConfig
    explicit: frozenset = frozenset()


@dataclass(kw_only=True)
class TaskConfig:
    """The flags every fine-tuning task has (the fine-tuning driver, megabert.training.finetune,
    reads these): tokenizer, feature length, how long to train, prediction batches and where
    the outputs go. A task's config dataclass (SQuAD's SquadConfig, GLUE's GlueConfig)
    subclasses it with its data files and options, and may give a field another default."""

    output_dir: Optional[str] = arg(None, "Where the predictions, eval_results.json and the task's other outputs go.")
    vocab_file: Optional[str] = arg(None, "WordPiece vocab.txt (or tokenizer.json; --tokenizer-model is the same "
                                    "flag); default the vocab.txt that came with --load (a Hugging Face or Google TF "
                                    "directory's, or beside a converted checkpoint).", aliases=("--tokenizer-model",))
    tokenizer_type: str = arg("BertWordPieceLowerCase", "Tokenizer type (lower-cased or cased WordPiece, or a "
                              "tokenizer.json); must match the pre-trained model.",
                              choices=("BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer"))
    max_seq_length: int = arg(128, "Tokens per feature, padded.")
    epochs: float = arg(3.0, "Passes over the training data (may be fractional).")
    train_iters: Optional[int] = arg(None, "Optimizer steps; default --epochs over the training data.")
    predict_batch_size: Optional[int] = arg(None, "Features per forward pass when predicting; default "
                                            "--micro-batch-size.")
    recompute_granularity: Optional[str] = arg(None, "Activation recompute: full (whole layers) or selective "
                                               "(attention core only); the losses are unchanged.",
                                               choices=(None, "full", "selective"))

    def __post_init__(self):
        if self.max_seq_length < 8:
            raise ConfigError(f"--max-seq-length must be at least 8, got {self.max_seq_length}")
        if self.epochs <= 0:
            raise ConfigError(f"--epochs must be positive, got {self.epochs}")
        check_at_least(self, 1, "train_iters", "predict_batch_size")


@dataclass(kw_only=True)
class PackedTaskConfig(TaskConfig):
    """A task whose training features pack into rows (megabert.data.packing: GLUE, NER):
    --pack-sequences and its two limits."""

    pack_sequences: bool = arg(False, "Train on rows of --max-seq-length filled with whole features (first-fit "
                                      "decreasing; attention stays inside each): --micro-batch-size and "
                                      "--global-batch-size then count rows. Evaluation and predictions are "
                                      "unpacked.")
    max_samples_per_row: int = arg(8, "With --pack-sequences: the most features one row holds.")
    packing_window: int = arg(1024, "With --pack-sequences: how many consecutive features are packed together.")

    def __post_init__(self):
        super().__post_init__()
        check_at_least(self, 1, "max_samples_per_row", "packing_window")


@dataclass
class FinetuneConfigs:
    """A fine-tuning entry script's configs: the model comes from --load, so no model or data
    section. `finetune` is the task's own config dataclass (SQuAD's SquadConfig, GLUE's
    GlueConfig), a TaskConfig."""
    parallel: ParallelConfig
    optim: OptimConfig
    train: TrainConfig
    finetune: TaskConfig
    explicit: frozenset = frozenset()

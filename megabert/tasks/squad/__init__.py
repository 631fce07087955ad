"""SQuAD v1.1/v2.0: reading the JSON, features over context windows, the span models
(BertForQuestionAnswering, ModernBertForQuestionAnswering), answers from logits, the official
scores, and SquadTask, what the fine-tuning driver (megabert.training.finetune) runs for
finetune_squad.py."""
from megabert.tasks.squad.model import BertForQuestionAnswering, ModernBertForQuestionAnswering, QuestionAnsweringOutput

__all__ = ["BertForQuestionAnswering", "ModernBertForQuestionAnswering", "QuestionAnsweringOutput"]

"""BERT built from tensor-parallel layers."""
from megabert.model.bert import BertForPreTraining, BertForQuestionAnswering, BertModel, attention_mask_to_bool
from megabert.model.outputs import BertPreTrainingOutput, QuestionAnsweringOutput

__all__ = ["BertModel", "BertForPreTraining", "BertForQuestionAnswering", "BertPreTrainingOutput",
           "QuestionAnsweringOutput", "attention_mask_to_bool"]

"""BERT built from tensor-parallel layers: one definition for every TP/PP layout."""
from megabert.model.bert import BertModel, BertPreTrainedModel, attention_mask_to_bool
from megabert.model.outputs import BertPreTrainingOutput, QuestionAnsweringOutput
from megabert.model.tasks import BertForPreTraining, BertForQuestionAnswering

MODEL_CLASSES = {cls.__name__: cls for cls in (BertModel, BertForPreTraining, BertForQuestionAnswering)}

__all__ = ["BertModel", "BertPreTrainedModel", "BertForPreTraining", "BertForQuestionAnswering",
           "BertPreTrainingOutput", "QuestionAnsweringOutput", "attention_mask_to_bool", "MODEL_CLASSES"]

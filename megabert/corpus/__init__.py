"""Offline corpus tooling, run before training (tools/): raw text or jsonl -> sentences ->
token ids -> Megatron's indexed dataset; Wikipedia dumps to jsonl; the demo corpus;
WordPiece vocab training. Nothing here runs inside a training job."""

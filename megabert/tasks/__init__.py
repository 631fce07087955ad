"""One package per task: its data, features, model head, loss, metrics and the glue that
hands them to the generic trainer (megabert.training). A new task is one package here and
one entry script; nothing outside them changes (its model classes join the table of
megabert.model_classes)."""

"""Model classes by name come from one table (megabert.model_classes), not from classes that
register themselves as their modules are imported: the table names every task model class
megabert defines and every family's task class, a lookup imports only the module it needs, and
an unknown name is a one-line error."""
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import megabert
from megabert import model_classes
from megabert.families import FAMILIES
from megabert.model.bert import BertPreTrainedModel

# The shared bases a task model class derives from: never built by name.
BASES = {"BertPreTrainedModel", "BertClassifier", "PredictionHeadTaskModel"}


def _defined_model_classes() -> set[str]:
    """Every BertPreTrainedModel subclass defined in megabert.model and the task packages."""
    names = set()
    for package in ("megabert.model", "megabert.tasks"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith(".model") or package == "megabert.model":
                module = importlib.import_module(info.name)
                names |= {obj.__name__ for obj in vars(module).values() if inspect.isclass(obj)
                          and issubclass(obj, BertPreTrainedModel) and obj.__module__ == module.__name__}
    return names


def test_the_table_names_every_model_class_and_each_family_task_class():
    classes = model_classes.every_class()
    assert all(cls.__name__ == name and cls.__module__ == model_classes.MODULES[name]
               for name, cls in classes.items())
    assert set(classes) == _defined_model_classes() - BASES
    assert {name for f in FAMILIES.values() for name in f.task_classes.values()} <= set(classes)


def test_a_lookup_imports_only_the_module_it_needs():
    code = ("import sys; from megabert import model_classes; "
            "assert not any(m.startswith('megabert.tasks') for m in sys.modules); "
            "cls = model_classes.by_name('BertForQuestionAnswering'); "
            "print(sorted(m for m in sys.modules if m.startswith('megabert.tasks.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["megabert.tasks.squad", "megabert.tasks.squad.model"]


def test_an_unknown_class_is_a_one_line_error():
    with pytest.raises(megabert.ConfigError, match=r"^unknown model class 'BertForTranslation' \(known: .*\)$"):
        model_classes.by_name("BertForTranslation")

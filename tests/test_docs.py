"""README.md and docs/ (issue 51, item 6): a README a newcomer reads in five minutes, whose
commands run as written, and a manual whose every command names flags its script has.

The flag check parses each ```bash block of README.md and docs/*.md and asks the script's own
--help (in process) for its flags: a flag renamed or removed on one branch and still documented
on another is reported with the file and line, all at once, so a merge can fix the docs in one
pass. The README's data commands and the layout planner run as written, on a small corpus; the
training commands are the demo's (tests/test_demo.py runs them at a smaller size)."""
from __future__ import annotations

import os
import re
import shlex

from tests.helpers.cli_utils import ROOT, run_main
from tests.helpers.doc_commands import commands, doc_files, help_flags

# Pages other branches write; README links them before they land. Remove a name once it is merged.
README_RUNS = ("tools/make_demo_corpus.py", "tools/train_tokenizer.py", "tools/preprocess_data.py",
               "tools/plan_layout.py")


def _readme() -> str:
    return open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def test_readme_is_short_and_keeps_the_two_commands():
    text = _readme()
    assert len(text.splitlines()) <= 250
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "make demo" in quick and "make test" in quick
    jobs = text.split("## One command per job", 1)[1].split("\n## ", 1)[0]
    for script in ("pretrain_bert.py", "--load hf_bert/", "finetune_squad.py", "finetune_glue.py", "finetune_ner.py",
                   "finetune_embeddings.py", "convert_hf.py", "plan_layout.py", "--nnodes"):
        assert script in jobs, script


def test_every_linked_page_exists():
    missing = []
    for doc in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+\.md)\)", open(os.path.join(ROOT, doc), encoding="utf-8").read()):
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target))
            if not os.path.isfile(os.path.join(ROOT, path)):
                missing.append(f"{doc} links {target}")
    assert not missing, missing


_helps: dict[tuple, set] = {}


def _flags_of(script: str, subcommand: str | None) -> set[str]:
    key = (script, subcommand)
    if key not in _helps:
        r = run_main(script, *([subcommand] if subcommand else []), "--help")
        assert r.returncode == 0, (script, r.stderr[-500:])
        _helps[key] = help_flags(r.stdout)
    return _helps[key]


def test_every_documented_flag_is_in_its_scripts_help():
    unknown = []
    checked = 0
    for doc in doc_files():
        for c in commands(doc):
            if c.script is None:
                continue
            checked += 1
            wrong = [f for f in c.flags if f not in _flags_of(c.script, c.subcommand)]
            if wrong:
                unknown.append(f"{c.where}: {c.script}{' ' + c.subcommand if c.subcommand else ''} has no "
                               f"{', '.join(wrong)}")
    assert checked >= 30, checked
    assert not unknown, "documented flags that the scripts do not have:\n" + "\n".join(unknown)


def test_readme_commands_run_as_written(tmp_path, monkeypatch):
    """In the README's order, in one directory: the corpus, its vocab, its dataset; the planner.
    One test, not one per command: each command reads what the one before it wrote, so they
    must not be spread over test workers."""
    monkeypatch.chdir(tmp_path)
    for script in README_RUNS:
        (command,) = [c for c in commands("README.md") if c.script == script]
        argv = shlex.split(command.text)
        assert argv[:2] == ["python", script], command.text
        r = run_main(script, *argv[2:])
        assert r.returncode == 0, f"{command.where}: {command.text}\n{r.stderr[-2000:]}"
        if script == "tools/preprocess_data.py":
            assert os.path.getsize(tmp_path / "corpus_text_sentence.bin") > 0
        if script == "tools/plan_layout.py":
            assert "layouts fit" in r.stdout

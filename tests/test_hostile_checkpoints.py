"""No checkpoint from outside runs code: hostile pickles end in one line, nothing run.

Payloads (tests/helpers/hostile_files.py, each shown live under plain pickle first): REDUCE
calls of posix.system / os.system / builtins.exec / builtins.eval, the protocol-4 dotted
chain from a torch.distributed.checkpoint module to os.system, and TCPStore as a DCP module
imports it. Placed where genuine files hold `args`, `rng_state`, a tensor, the whole rank
file (Megatron `torch` format, zip and pre-1.6), `common.pt`, in front of a genuine
`.metadata`, a Hugging Face `pytorch_model.bin` and megabert's own rank files. Each reader
is parametrized over all payloads; each entry point (pretrain_bert.py / finetune_squad.py /
finetune_glue.py --load, convert_megatron.py / convert_hf.py import, from_pretrained of the
pre-training and QA models) over one or two placements: the marker never appears, the API
raises RefusedFileError and a script prints exactly one stderr line and exits non-zero. A
wrong type where a Metadata, dict or args belong is the same kind of line. A genuine
pre-1.6 Megatron file loads to the zip file's weights.
"""
import argparse
import collections
import io
import os
import pickle
import shutil
import struct

import pytest
import torch

import megabert
from megabert.checkpoint import safe_pickle
from megabert.checkpoint.megatron.safe_load import load_dcp_metadata, safe_torch_load
from megabert.errors import CheckpointError, RefusedFileError
from tests.helpers import hostile_files as h
from tests.helpers import pretrain_runs
from tests.helpers.cli_utils import run_main
from tests.helpers.megatron_files import FIXTURES, write_megatron_dir
from tests.helpers.pretrain_runs import pretrain_args
from tests.helpers.squad_demo import DEMO

RANK = os.path.join("iter_0000010", "mp_rank_00", "model_optim_rng.pt")
OWN_RANK = os.path.join("release", "mp_rank_00", "model_optim_rng.pt")
DIST = os.path.join(FIXTURES, "tp1_torch_dist")


# ---------------------------------------------------------------- genuine files, once per module

@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A Megatron `torch` dir (TP 1), its rank payload, a Hugging Face dir and megabert's own checkpoint."""
    d = tmp_path_factory.mktemp("genuine")
    megatron = write_megatron_dir(str(d / "megatron"), 1)
    payload = torch.load(os.path.join(megatron, RANK), weights_only=False)  # written just above
    from tests.helpers.hf_models import make_hf_dir
    hf = make_hf_dir(d / "hf")
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf, "--output", str(d / "own"))
    assert r.returncode == 0, r.stderr
    own = torch.load(os.path.join(d / "own", OWN_RANK), weights_only=False)
    return {"megatron": megatron, "payload": payload, "hf": hf, "own_dir": str(d / "own"), "own": own}


def megatron_dir(genuine, tmp_path, place=None, raw=None, *, legacy=False):
    """A copy of the Megatron dir whose rank file holds `raw` at `place` ("whole": the file itself)."""
    d = str(tmp_path / "megatron")
    shutil.copytree(genuine["megatron"], d)
    payload = dict(genuine["payload"])
    if place == "whole":
        payload = h.Raw(raw)
    elif place is not None:
        payload[place] = h.Raw(raw)
    h.save(payload, os.path.join(d, RANK), legacy=legacy)
    return d


def dist_dir(tmp_path, *, metadata=None, common=None):
    """A copy of megatron-core's torch_dist fixture with `.metadata` bytes / a `common.pt` object replaced."""
    d = str(tmp_path / "dist")
    shutil.copytree(DIST, d)
    it = os.path.join(d, "iter_0000010")
    if metadata is not None:
        with open(os.path.join(it, ".metadata"), "wb") as f:
            f.write(metadata)
    if common is not None:
        h.save(common, os.path.join(it, "common.pt"))
    return d


def genuine_metadata():
    with open(os.path.join(DIST, "iter_0000010", ".metadata"), "rb") as f:
        return pickle.load(f)  # megatron-core's own fixture


def hf_dir(genuine, tmp_path, state, *, legacy=False):
    """The Hugging Face dir with pytorch_model.bin holding `state` in place of its safetensors."""
    d = str(tmp_path / "hf")
    shutil.copytree(genuine["hf"], d)
    os.remove(os.path.join(d, "model.safetensors"))
    h.save(state, os.path.join(d, "pytorch_model.bin"), legacy=legacy)
    return d


def own_dir(genuine, tmp_path, place, raw):
    d = str(tmp_path / "own")
    shutil.copytree(genuine["own_dir"], d)
    payload = dict(genuine["own"])
    payload[place] = h.Raw(raw)
    h.save(payload, os.path.join(d, OWN_RANK))
    return d


def refused(fn, marker):
    """fn() raises RefusedFileError, one line naming what was refused; the marker never appears."""
    with pytest.raises(RefusedFileError) as e:
        fn()
    text = str(e.value)
    assert "\n" not in text and "refused" in text and "weights_only" not in text, text
    assert not os.path.exists(marker)
    return text


# ---------------------------------------------------------------- the payloads are live

@pytest.mark.parametrize("kind", ["posix.system", "builtins.exec", "builtins.eval", "chain"])
def test_each_payload_runs_under_plain_pickle(tmp_path, kind):
    marker = str(tmp_path / "ran")
    h.runs_under_plain_pickle(h.standalone(h.payload(kind, marker)))
    assert os.path.exists(marker)  # so a reader that lets it through would create it


NAMED = {"posix.system": "posix.system", "os.system": "os.system", "builtins.exec": "builtins.exec",
         "builtins.eval": "builtins.eval", "chain": "torch.distributed.checkpoint.filesystem.operator.",
         "tcpstore": "torch.distributed.checkpoint._async_process_executor.TCPStore"}


# ---------------------------------------------------------------- each reader, each payload

@pytest.mark.parametrize("kind", h.PAYLOADS)
@pytest.mark.parametrize("place,legacy", [("args", False), ("rng_state", False), ("whole", False),
                                          ("args", True), ("whole", True)])
def test_megatron_rank_file(genuine, tmp_path, kind, place, legacy):
    marker = str(tmp_path / "ran")
    d = megatron_dir(genuine, tmp_path, place, h.payload(kind, marker), legacy=legacy)
    text = refused(lambda: safe_torch_load(os.path.join(d, RANK)), marker)
    assert text.startswith(os.path.join(d, RANK) + ": refused: it names " + NAMED[kind]), text


@pytest.mark.parametrize("kind", h.PAYLOADS)
def test_dcp_metadata_with_a_payload_in_front(tmp_path, kind):
    marker = str(tmp_path / "ran")
    d = dist_dir(tmp_path, metadata=h.in_front_of(h.payload(kind, marker), genuine_metadata()))
    path = os.path.join(d, "iter_0000010", ".metadata")
    text = refused(lambda: load_dcp_metadata(path), marker)
    assert text.startswith(f"{path}: refused: it names {NAMED[kind]}"), text


@pytest.mark.parametrize("kind", h.PAYLOADS)
@pytest.mark.parametrize("place", ["args", "whole"])
def test_common_pt(tmp_path, kind, place):
    marker = str(tmp_path / "ran")
    raw = h.Raw(h.payload(kind, marker))
    d = dist_dir(tmp_path, common=raw if place == "whole" else {"args": raw, "iteration": 10})
    refused(lambda: megabert.checkpoint.megatron.read_header(d), marker)


@pytest.mark.parametrize("kind", h.PAYLOADS)
@pytest.mark.parametrize("legacy", [False, True])
def test_hf_pytorch_model_bin(genuine, tmp_path, kind, legacy):
    from megabert.checkpoint.hf import read_hf_state
    marker = str(tmp_path / "ran")
    d = hf_dir(genuine, tmp_path, {"bert.embeddings.word_embeddings.weight": h.Raw(h.payload(kind, marker))},
               legacy=legacy)
    refused(lambda: read_hf_state(d), marker)


@pytest.mark.parametrize("kind", h.PAYLOADS)
@pytest.mark.parametrize("place", ["rng", "model_config"])
def test_megabert_own_rank_file(genuine, tmp_path, kind, place):
    from megabert.checkpoint.layout import load_file
    marker = str(tmp_path / "ran")
    d = own_dir(genuine, tmp_path, place, h.payload(kind, marker))
    refused(lambda: load_file(os.path.join(d, OWN_RANK)), marker)


def test_a_dcp_tensor_item_is_read_through_the_allow_list(tmp_path):
    """A .distcp tensor item (a torch.save blob) that names posix.system: refused by SafeReader,
    not passed to torch's weights-only unpickler (whose message advises weights_only=False)."""
    from megabert.checkpoint.megatron import dist_format
    marker = str(tmp_path / "ran")
    d = dist_dir(tmp_path)
    it = os.path.join(d, "iter_0000010")
    md = load_dcp_metadata(os.path.join(it, ".metadata"))
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == "embedding.word_embeddings.weight")
    h.save(h.Raw(h.payload("posix.system", marker)), os.path.join(it, "hostile.bin"))
    with open(os.path.join(it, "hostile.bin"), "rb") as f:
        blob = f.read()
    with open(os.path.join(it, info.relative_path), "ab") as f:
        offset = f.tell()
        f.write(blob)
    info.offset, info.length = offset, len(blob)
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    text = refused(lambda: dist_format.read_full(it), marker)
    assert "it names posix.system" in text and "embedding.word_embeddings.weight" in text


# ---------------------------------------------------------------- a wrong type where a Metadata / dict / args belong

def _rank_file_with(genuine, tmp_path, **entries):
    d = str(tmp_path / "megatron")
    shutil.copytree(genuine["megatron"], d)
    torch.save(dict(genuine["payload"], **entries), os.path.join(d, RANK))
    return d


def _own_file_with(genuine, tmp_path, **entries):
    d = str(tmp_path / "own")
    shutil.copytree(genuine["own_dir"], d)
    torch.save(dict(genuine["own"], **entries), os.path.join(d, OWN_RANK))
    return d


def _wrong_type_cases(genuine, tmp_path):
    """(checkpoint dir, what the line says it held where)."""
    args = vars(genuine["payload"]["args"])
    return [
        (dist_dir(tmp_path / "a", metadata=pickle.dumps({"state_dict_metadata": {}})),
         "a builtins.dict where torch.distributed.checkpoint's Metadata belongs"),
        (dist_dir(tmp_path / "b", common=[1, 2]), "a builtins.list where the dict Megatron saves belongs"),
        (_rank_file_with(genuine, tmp_path / "c", args="--num-layers 2"), "a builtins.str where args ("),
        (_rank_file_with(genuine, tmp_path / "d", args=argparse.Namespace(**{**args, "layernorm_epsilon": "e"})),
         "a builtins.str where args.layernorm_epsilon (int or float) belongs"),
        (_rank_file_with(genuine, tmp_path / "e", args=argparse.Namespace(**{**args, "vocab_size": "x"})),
         "a builtins.str where args.vocab_size (int) belongs"),
        (_rank_file_with(genuine, tmp_path / "f", model=[torch.zeros(2)]),
         "a builtins.list where the model's state dict (a dict) belongs"),
        (_rank_file_with(genuine, tmp_path / "g", iteration="ten"), "a builtins.str where 'iteration' (a number)"),
        (hf_dir(genuine, tmp_path / "h", [torch.zeros(2)]), "a builtins.list where a state dict belongs"),
        (_own_file_with(genuine, tmp_path / "i", model_config=None), "a builtins.NoneType where its 'model_config'"),
        (_own_file_with(genuine, tmp_path / "j", rng=[1]), "a builtins.list where its 'rng' (a dict) belongs"),
    ]


def test_a_wrong_type_is_one_line(genuine, tmp_path):
    for d, held in _wrong_type_cases(genuine, tmp_path):
        with pytest.raises(RefusedFileError) as e:
            megabert.BertForPreTraining.from_pretrained(d)
        text = str(e.value)
        assert "\n" not in text and f"refused: it holds {held}" in text, text


def test_damaged_files_are_one_line_without_torch_advice(genuine, tmp_path):
    d = megatron_dir(genuine, tmp_path)
    with open(os.path.join(d, RANK), "r+b") as f:
        f.truncate(300)
    with pytest.raises(CheckpointError) as e:
        megabert.BertForPreTraining.from_pretrained(d)
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)


# ---------------------------------------------------------------- pre-1.6 files

# 2019-2020 Megatron-LM's FP16_Optimizer pickled its loss scaler object into `optimizer`, under
# its then top-level `fp16` package: DynamicLossScaler() with its state (NEWOBJ, BUILD).
LOSS_SCALER = (h.global_("fp16.loss_scaler", "DynamicLossScaler") + b")\x81" + b"}(" + h.s("cur_scale")
               + b"G" + struct.pack(">d", 65536.0) + h.s("scale_window") + b"M\xe8\x03" + b"ub")


def test_a_legacy_megatron_file_loads_as_its_zip_twin(genuine, tmp_path):
    """A rank file in torch's pre-1.6 format, with what that era's optimizer state held, reads
    as the zip file does."""
    legacy = megatron_dir(genuine, tmp_path, "optimizer", b"}(" + h.s("loss_scaler") + LOSS_SCALER + b"u",
                          legacy=True)
    with open(os.path.join(legacy, RANK), "rb") as f:
        assert f.read(2) == b"\x80\x04"  # a pickle stream: torch's pre-1.6 format, no zip
    zipped = megabert.BertForPreTraining.from_pretrained(genuine["megatron"], attention_backend="torch").state_dict()
    read = megabert.BertForPreTraining.from_pretrained(legacy, attention_backend="torch").state_dict()
    assert set(read) == set(zipped)
    assert all(torch.equal(read[k], zipped[k]) for k in zipped)


def test_a_legacy_pytorch_model_bin_loads(genuine, tmp_path):
    from safetensors.torch import load_file

    from megabert.checkpoint.hf import read_hf_state
    state = load_file(os.path.join(genuine["hf"], "model.safetensors"))
    read = read_hf_state(hf_dir(genuine, tmp_path, state, legacy=True))
    assert set(read) == set(state) and all(torch.equal(read[k], state[k]) for k in state)


# ---------------------------------------------------------------- each entry point

def _one_line(r, marker, fragment):
    assert r.returncode != 0
    assert not os.path.exists(marker)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert "refused" in lines[0] and fragment in lines[0] and "weights_only" not in lines[0], lines[0]
    return lines[0]


CASES = {  # case -> (build(genuine, tmp_path, marker) -> checkpoint dir, fragment of the line)
    "metadata-chain": (lambda g, t, m: dist_dir(t, metadata=h.in_front_of(h.payload("chain", m), genuine_metadata())),
                       "operator.methodcaller"),
    "legacy-args-posix.system": (lambda g, t, m: megatron_dir(g, t, "args", h.payload("posix.system", m),
                                                              legacy=True), "posix.system"),
    "rank-whole-exec": (lambda g, t, m: megatron_dir(g, t, "whole", h.payload("builtins.exec", m)), "builtins.exec"),
    "rng_state-eval": (lambda g, t, m: megatron_dir(g, t, "rng_state", h.payload("builtins.eval", m)),
                       "builtins.eval"),
    "common-tcpstore": (lambda g, t, m: dist_dir(t, common={"args": h.Raw(h.payload("tcpstore", m))}), "TCPStore"),
    "own-rng-posix.system": (lambda g, t, m: own_dir(g, t, "rng", h.payload("posix.system", m)), "posix.system"),
    "hf-bin-os.system": (lambda g, t, m: hf_dir(g, t, {"x": h.Raw(h.payload("os.system", m))}), "os.system"),
}


def _case(genuine, tmp_path, case):
    """(marker, checkpoint dir, fragment) of one entry-point case."""
    marker = str(tmp_path / "ran")
    build, fragment = CASES[case]
    return marker, build(genuine, tmp_path, marker), fragment


@pytest.mark.parametrize("case", ["metadata-chain", "legacy-args-posix.system", "rng_state-eval", "common-tcpstore",
                                  "own-rng-posix.system", "hf-bin-os.system"])
@pytest.mark.parametrize("cls", ["BertForPreTraining", "BertForQuestionAnswering"])
def test_from_pretrained(genuine, tmp_path, case, cls):
    marker, path, fragment = _case(genuine, tmp_path, case)
    text = refused(lambda: getattr(megabert, cls).from_pretrained(path), marker)
    assert fragment in text


@pytest.mark.parametrize("case", ["metadata-chain", "own-rng-posix.system"])
def test_pretrain_bert_load(genuine, dataset, tmp_path, case):
    marker, path, fragment = _case(genuine, tmp_path, case)
    r = pretrain_runs.run_main(*map(str, pretrain_args(dataset, tmp_path / "m.jsonl", "--load", path)))
    _one_line(r, marker, fragment)


@pytest.mark.parametrize("case", ["metadata-chain", "legacy-args-posix.system", "rank-whole-exec"])
def test_convert_megatron_import(genuine, tmp_path, case):
    marker, path, fragment = _case(genuine, tmp_path, case)
    r = run_main("tools/checkpoint/convert_megatron.py", "import", "--megatron-dir", path, "--output",
                 str(tmp_path / "out"))
    _one_line(r, marker, fragment)
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")


def test_convert_hf_import(genuine, tmp_path):
    marker, path, fragment = _case(genuine, tmp_path, "hf-bin-os.system")
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", path, "--output", str(tmp_path / "out"))
    _one_line(r, marker, fragment)


@pytest.mark.parametrize("case", ["metadata-chain", "own-rng-posix.system"])
def test_finetune_squad_load(genuine, dataset, tmp_path, case):
    marker, path, fragment = _case(genuine, tmp_path, case)
    r = run_main("finetune_squad.py", "--load", path, "--vocab-file", str(dataset / "vocab.txt"), "--train-file",
                 os.path.join(DEMO, "train.json"), "--output-dir", str(tmp_path / "out"), "--max-seq-length", "64",
                 "--doc-stride", "16", "--max-query-length", "24", "--train-iters", "1")
    _one_line(r, marker, fragment)


@pytest.mark.parametrize("case", ["metadata-chain", "rank-whole-exec"])
def test_finetune_glue_load(genuine, dataset, tmp_path, case):
    from tests.helpers.glue_files import write
    marker, path, fragment = _case(genuine, tmp_path, case)
    data = tmp_path / "SST-2"
    data.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        write(data / name, ["sentence\tlabel"] + [f"the cat sat\t{i % 2}" for i in range(8)])
    r = run_main("finetune_glue.py", "--task-name", "sst-2", "--data-dir", str(data), "--load", path, "--vocab-file",
                 str(dataset / "vocab.txt"), "--output-dir", str(tmp_path / "out"), "--max-seq-length", "32",
                 "--micro-batch-size", "8", "--train-iters", "1", "--no-do-predict")
    _one_line(r, marker, fragment)


# ---------------------------------------------------------------- the table itself

def test_names_are_exact_pairs():
    """A name resolves only as written: dotted qualified names, names a module merely imports and
    look-alikes are refused even under the modules whose own names are allowed or inert."""
    from megabert.checkpoint.megatron.safe_load import MEGATRON, dcp_allowed
    for allowed in (MEGATRON, dcp_allowed()):
        find = safe_pickle.unpickler_class(allowed)(io.BytesIO(b"")).find_class
        for module, name in (("torch._utils", "os.system"), ("torch", "_utils._rebuild_tensor_v2"),
                             ("torch.distributed.checkpoint.filesystem", "os"),
                             ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
                             ("megatron.core.enums", "ModelType.__reduce__"), ("megatron", "os.system"),
                             ("collections", "OrderedDict.fromkeys"), ("torch", "load"), ("torch", "Tensor.__new__"),
                             ("builtins", "getattr"), ("numpy", "load"), ("copyreg", "_reconstructor")):
            with pytest.raises(safe_pickle._Refused):
                find(module, name)
    find = safe_pickle.unpickler_class(MEGATRON)(io.BytesIO(b"")).find_class
    enum = find("megatron.core.transformer.enums", "AttnBackend")
    assert issubclass(enum, safe_pickle.ForeignObject) and enum(4).args == (4,)  # recorded, nothing run
    assert find("fp16.loss_scaler", "DynamicLossScaler").qualified_name == "fp16.loss_scaler.DynamicLossScaler"
    assert find("torch._utils", "_rebuild_tensor_v2") is not torch._utils._rebuild_tensor_v2  # hooks refused
    assert find("collections", "OrderedDict") is collections.OrderedDict


def test_backward_hooks_on_a_tensor_are_refused():
    """torch.save never writes a hook (it warns and drops them); a file that does would have one
    run on backward: the rebuild helpers refuse it."""
    from megabert.checkpoint.megatron.safe_load import MEGATRON
    find = safe_pickle.unpickler_class(MEGATRON)(io.BytesIO(b"")).find_class
    storage = torch.storage.TypedStorage(wrap_storage=torch.ones(2).untyped_storage(), dtype=torch.float32,
                                         _internal=True)  # as torch.load's persistent_load hands it over
    with pytest.raises(safe_pickle._Refused, match="backward hooks"):
        find("torch._utils", "_rebuild_tensor_v2")(storage, 0, (2,), (1,), False,
                                                   collections.OrderedDict([(0, torch.Size)]))
    t = find("torch._utils", "_rebuild_tensor_v2")(storage, 0, (2,), (1,), False, collections.OrderedDict())
    assert torch.equal(t, torch.ones(2))


def test_a_rank_file_that_is_no_dict_is_one_line(genuine, tmp_path):
    d = megatron_dir(genuine, tmp_path)
    torch.save([torch.zeros(2)], os.path.join(d, RANK))
    with pytest.raises(RefusedFileError, match="it holds a builtins.list where the dict a rank file holds belongs"):
        megabert.BertForPreTraining.from_pretrained(d)

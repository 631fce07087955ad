"""HF -> megabert (TP=2, and TP=2 x PP=2) -> HF is bit-identical; transformers loads the
export; the converted checkpoint loads at TP 1 and 2; a bad layout is a one-line error."""
import os

import pytest
import torch
from safetensors.torch import load_file

import megabert

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import VOCAB, batch, close, make_hf_dir


transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert(*args):
    """convert_hf.py's main() in process (cli_utils): its command line is the demo's."""
    return run_main("tools/checkpoint/convert_hf.py", *map(str, args))


@pytest.mark.parametrize("arch,tp,pp", [("BertForPreTraining", 2, 1), ("BertForPreTraining", 2, 2),
                                        ("BertForQuestionAnswering", 2, 1)])
def test_roundtrip_bit_identical(tmp_path, arch, tp, pp):
    hf_dir = make_hf_dir(tmp_path / "hf", arch)
    r = convert("import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ckpt"),
                "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp))
    assert r.returncode == 0, r.stderr
    suffix = "" if pp == 1 else "_000"
    assert os.path.isfile(tmp_path / "ckpt" / "release" / f"mp_rank_01{suffix}" / "model_optim_rng.pt")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "release"
    vocab = tmp_path / "vocab.txt"  # the export writes a tokenizer, so it needs a vocab of the model's size
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]))
    r = convert("export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"),
                "--vocab-file", str(vocab))
    assert r.returncode == 0, r.stderr
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    for k in original:
        assert torch.equal(exported[k], original[k]), k
    loaded = getattr(transformers, arch).from_pretrained(str(tmp_path / "out"))
    ref = getattr(transformers, arch).from_pretrained(hf_dir)
    for (n, a), (_, b) in zip(loaded.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n


def _load_converted(rank, world, ckpt, hf_dir):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    model = megabert.BertForPreTraining.from_pretrained(ckpt, ps, attention_backend="torch")
    hf = transformers.BertForPreTraining.from_pretrained(hf_dir, attn_implementation="eager")
    ids, tt, am, _ = batch()
    with torch.no_grad():
        out = model(ids, token_type_ids=tt, attention_mask=am)
        ref = hf(input_ids=ids, token_type_ids=tt, attention_mask=am)
    close(out.mlm_logits, ref.prediction_logits, "mlm logits")
    close(out.nsp_logits, ref.seq_relationship_logits, "nsp logits")


@pytest.mark.parametrize("world", [1, 2])
def test_converted_checkpoint_loads_at_any_tp(tmp_path, world):
    hf_dir = make_hf_dir(tmp_path / "hf")
    assert convert("import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ckpt"),
                   "--tensor-model-parallel-size", "2").returncode == 0
    run_distributed(_load_converted, world, str(tmp_path / "ckpt"), hf_dir)


def test_bad_layout_is_one_line_error(tmp_path):
    hf_dir = make_hf_dir(tmp_path / "hf")  # 4 heads, ffn 64
    r = convert("import", "--hf-dir", hf_dir, "--output", str(tmp_path / "c"), "--tensor-model-parallel-size", "3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"
    r = convert("import", "--hf-dir", str(tmp_path / "nothing"), "--output", str(tmp_path / "c"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--hf-dir" in r.stderr


def test_pytorch_model_bin_with_legacy_names(tmp_path):
    """Old hub checkpoints: pytorch_model.bin (read with weights_only) and LayerNorm gamma/beta."""
    hf_dir = make_hf_dir(tmp_path / "hf")
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(legacy, bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    ps = megabert.init_parallel()
    a = megabert.BertForPreTraining.from_pretrained(str(bin_dir), ps)
    b = megabert.BertForPreTraining.from_pretrained(hf_dir, ps)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n

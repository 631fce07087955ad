"""Change a megabert checkpoint's layout (model weights and optimizer state):

    reshard.py --load ckpt_tp2/ --save ckpt_tp4/ --tensor-model-parallel-size 4
    reshard.py --load ckpt_tp2/ --save ckpt_pp2/ --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    reshard.py --load ckpt/ --save ckpt_pp2/ --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
        --decoder-first-pipeline-num-layers 2      (5 layers: 2 on the first stage, 3 on the last)

`pretrain_bert.py --load ckpt_tp4/` then continues the run at the new layout.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from megabert.checkpoint.layout import commit, read_tracker, staging_dir, write_rank_file
from megabert.checkpoint.reader import read_model_config, read_rank
from megabert.checkpoint.start import Format, require_source
from megabert.errors import ConfigError, cli_main
from megabert.parallel.layout import StageLayout
from megabert.paths import DIR, OUT_DIR, check_paths


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint to read (root or iteration directory)")
    p.add_argument("--save", required=True, help="where to write the resharded checkpoint")
    p.add_argument("--tensor-model-parallel-size", type=int, required=True)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="chunk size of the interleaved schedule the new checkpoint will train with")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (uneven stages; the others share the rest evenly)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (uneven stages; the others share the rest evenly)")
    args = p.parse_args(argv)
    if os.path.abspath(args.load) == os.path.abspath(args.save):
        raise ConfigError("--save must differ from --load: resharding writes a new checkpoint")
    check_paths([(args.load, "--load", DIR), (args.save, "--save", OUT_DIR)])
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    source = require_source(args.load)  # what --load holds, detected once
    num_layers = read_model_config(source)["num_layers"]
    tag = read_tracker(args.load) or "release"
    tag = tag if tag == "release" else int(tag)
    os.makedirs(args.save, exist_ok=True)
    shutil.rmtree(staging_dir(args.save, tag), ignore_errors=True)
    external = source.format is Format.MEGATRON
    # One new rank at a time, as the ranks of a run at the new layout would read it.
    for p in range(pp):
        stage = StageLayout(num_layers, pp, p, args.num_layers_per_virtual_pipeline_stage,
                            args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
        for t in range(tp):
            # A Megatron directory's moments continue through --load itself (under the run's own
            # param groups); convert_megatron.py import is its conversion, weights only.
            ckpt = read_rank(source, tp_rank=t, tp_size=tp, stage=stage, optimizer=not external)
            write_rank_file(staging_dir(args.save, tag), t, p, pp, ckpt.payload)
    print(f"wrote {commit(args.save, tag)} (tp={tp}, pp={pp})")


if __name__ == "__main__":
    sys.exit(main())

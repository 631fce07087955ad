"""The newcomer's end-to-end run (`make demo`). Stages that have not landed yet are
named as such; nothing here prints a made-up result."""
import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", default="demo_out")
    p.parse_args()
    import torch

    import megabert
    from megabert import fused_kernels

    print(f"megabert {megabert.__version__}, torch {torch.__version__}, "
          f"fused kernels built: {fused_kernels.is_available()}")
    print("still to come in this demo: corpus -> vocab -> preprocess -> TP=2 pre-training -> SQuAD")
    return 0


if __name__ == "__main__":
    sys.exit(main())

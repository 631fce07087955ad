"""megabert/data/helpers.cpp's two builders, the only door to the compiled extension: the BERT
sample mapping (sample_mapping) and the blend's interleaving indices (blending). Required:
never silently replaced by a slow path."""
try:
    from megabert.data._helpers import build_blending_indices, build_sample_mapping
except ImportError as e:
    raise ImportError(f"megabert.data._helpers (megabert/data/helpers.cpp) is not built ({e}); "
                      f"run `make install` (or `pip install --no-build-isolation -e .`)") from e

__all__ = ["build_blending_indices", "build_sample_mapping"]

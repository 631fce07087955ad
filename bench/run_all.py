"""`make bench`: every CPU benchmark in bench/, one after another, figures to stdout (the
`gpu_*` ones need a GPU: `make bench-gpu` runs them)."""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
failed = []
for name in sorted(os.listdir(here)):
    if name.endswith(".py") and name != "run_all.py" and not name.startswith(("_", "gpu_")):
        print(f"\n=== bench/{name}", flush=True)
        if subprocess.call([sys.executable, os.path.join(here, name)]) != 0:
            failed.append(name)
if failed:
    sys.exit(f"benchmarks that did not run to the end: {', '.join(failed)}")

# Sourced by the launch scripts: which python and launchers to run. The repo's .venv (what
# `make install` builds, extensions included) wins over whatever the PATH has first, so a
# script works from a fresh shell without activating anything; with no .venv the PATH's
# tools run, and a one-line note says how to get the venv.
#   PYTHON     the interpreter (workers under srun and mpirun run it)
#   TORCHRUN   torchrun, as `python -m torch.distributed.run` (no reliance on a console script)
#   DEEPSPEED  the deepspeed launcher;  MPIRUN  mpirun (the mpich wheel's, else the system's)
MEGABERT_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_venv_bin="${MEGABERT_REPO}/.venv/bin"
if [ -x "${_venv_bin}/python" ]; then
  PYTHON="${_venv_bin}/python"
  DEEPSPEED="${_venv_bin}/deepspeed"
  MPIRUN="${_venv_bin}/mpirun"
  [ -x "${DEEPSPEED}" ] || DEEPSPEED=deepspeed
  [ -x "${MPIRUN}" ] || MPIRUN=mpirun  # the venv has none without the [mpi] extra: a system MPI
else
  echo "note: no ${MEGABERT_REPO}/.venv, so python and the launchers come from PATH" \
    "(run 'make install' in ${MEGABERT_REPO}, or 'source VENV/bin/activate' for your own venv)" >&2
  PYTHON=python
  DEEPSPEED=deepspeed
  MPIRUN=mpirun
fi
TORCHRUN=("${PYTHON}" -m torch.distributed.run)
unset _venv_bin

# megabert: `make demo` and `make test` do all set-up on a fresh machine.
# `make install` creates .venv in the repo root and installs megabert into it with its
# C++ extensions built; it is idempotent and does nothing when nothing changed.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.megabert-installed
# A CPU build of this torch lies on the development machines' disk; a bare `torch`
# would pull a multi-GB CUDA build. A torch already in the venv (a GPU machine's) is kept.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= deepspeed,mpi,test
SOURCES := Makefile setup.py pyproject.toml $(shell find megabert -name '*.cpp' -o -name '*.cu' -o -name '*.h' 2>/dev/null)
PYTEST_ARGS ?=
# pytest-xdist workers, one test file per worker at a time (files share module fixtures and
# fixed ports). Most tests are process start-ups, imports and small spawned runs that keep
# one core busy; two workers keep both busy. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: install test demo bench bench-gpu cuda-check clean

install: $(STAMP)

# WHEELHOUSE=DIR: install from that folder of wheels alone, no index (a GPU image with no
# registry; tools/gpu/make_wheelhouse.sh fills it). Empty: the configured index, as usual.
WHEELHOUSE ?=
PIP_SOURCE := $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE)))

$(VPY):
	# A $(PYTHON) that already imports a CUDA torch (a GPU image's) lends it to the venv.
	$(PYTHON) tools/gpu/make_venv.py $(VENV)
	$(if $(WHEELHOUSE),,$(VPY) -m pip install -q --upgrade "pip>=24" setuptools wheel)

$(STAMP): $(VPY) $(SOURCES)
	@$(VPY) -c "import torch" 2>/dev/null \
	  && echo "keeping torch $$($(VPY) -c 'import torch; print(torch.__version__)')" \
	  || $(VPY) -m pip install -q $(PIP_SOURCE) "$(TORCH_SPEC)"
	$(VPY) -m pip install -q $(PIP_SOURCE) ninja numpy "pybind11>=2.12"
	# megabert's extensions and DeepSpeed build with --no-build-isolation: they compile
	# against the torch in the venv (an isolated build env would fetch another torch). Every
	# other dependency builds isolated, with a current setuptools (seqeval is an sdist alone,
	# and built against the venv's setuptools it calls itself 0.0.0: tools/requirements.py).
	# The C++ build keeps both cores busy for about a minute, the dependencies' install mostly
	# one: two pips side by side on disjoint packages (without tomllib, Python < 3.11, one
	# after the other).
	@if $(VPY) tools/requirements.py $(EXTRAS) > $(VENV)/requirements.txt \
	    && $(VPY) tools/requirements.py --against-torch $(EXTRAS) > $(VENV)/requirements-torch.txt; then \
	  echo "building megabert's extensions while pip installs its dependencies"; \
	  $(VPY) -m pip install -q $(PIP_SOURCE) --no-build-isolation --no-deps -e . > $(VENV)/build.log 2>&1 & build=$$!; \
	  $(VPY) -m pip install -q $(PIP_SOURCE) -r $(VENV)/requirements.txt \
	    && { [ ! -s $(VENV)/requirements-torch.txt ] \
	         || $(VPY) -m pip install -q $(PIP_SOURCE) --no-build-isolation -r $(VENV)/requirements-torch.txt; }; deps=$$?; \
	  wait $$build || { cat $(VENV)/build.log; echo "make install: building megabert failed (log above)"; exit 1; }; \
	  exit $$deps; \
	else \
	  $(VPY) -m pip install -q $(PIP_SOURCE) --no-build-isolation -e ".[$(EXTRAS)]"; \
	fi
	$(VPY) -c "import megabert, megabert.fused_kernels as fk; print('megabert', megabert.__version__, '| fused kernels:', fk.is_available())"
	@touch $(STAMP)

test: install
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

demo: install
	$(VPY) examples/demo.py --workdir demo_out

bench: install
	$(VPY) bench/run_all.py

# On a GPU machine (make install reuses its CUDA torch; WHEELHOUSE, default wheelhouse/ when
# it exists, stands in for a registry): builds the CUDA kernels, runs their tests against
# PyTorch, the kernel, BERT-large, ModernBERT-base and memory benches; logs and summary.json under OUT
# (default bench_out/). Without a GPU it stops, in one line, at the first step that needs one.
bench-gpu:
	$(PYTHON) tools/gpu/bench_gpu.py

# Builds the CUDA kernels for sm_80/sm_90 on a machine without a GPU (warnings as errors) and
# prints registers and spills per kernel; fails on an error, a warning or a spill. The
# CUDA torch lives in a side venv so that .venv's CPU torch and extensions stay as they are.
CUDA_VENV       := .venv-cuda
CUDA_VPY        := $(CUDA_VENV)/bin/python
CUDA_TORCH_SPEC ?= torch==2.14.1

$(CUDA_VENV)/.ready:
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VPY) -m pip install -q "$(CUDA_TORCH_SPEC)" ninja numpy "pybind11>=2.12" setuptools wheel
	@touch $@

cuda-check: $(CUDA_VENV)/.ready
	$(CUDA_VPY) tools/gpu/cuda_check.py

clean:
	rm -rf build *.egg-info demo_out
	find megabert -name '*.so' -delete

# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default; a GPU user overrides it, e.g. `make demo TORCH_SPEC="torch==2.13.0 --index-url ..."`.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINT_PATHS := lightning_resilience recipes hydra_plugins setup.py tests $(wildcard benchmarks)

# An editable install maps our packages through an import hook, which Hydra's plugin scan (pkgutil) cannot list:
# the checkout goes on the venv's path too, so hydra_plugins/ is found as it is in an installed wheel.
repo_on_path = $(1) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], \
	'lightning_resilience_checkout.pth').write_text('$(CURDIR)\n')"

.PHONY: venv nemo-venv demo launch-drills readme-drills slurm test lint typecheck unit bench gpu-check clean \
	drills-data drills stalls-before-after drills-loaders

$(STAMP): setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[dev]"
	$(call repo_on_path,$(BIN)/python)
	touch $(STAMP)

venv: $(STAMP)

# A real NeMo (it pins lightning 2.4) in its own environment, for tests/integrations/test_nemo.py; our package is
# installed without its dependencies so that NeMo's pins stay as they are.
NEMO_VENV ?= .venv-nemo
NEMO_STAMP := $(NEMO_VENV)/.installed
$(NEMO_STAMP): setup.cfg setup.py pyproject.toml
	$(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_VENV)/bin/pip install -q --upgrade pip
	$(NEMO_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(NEMO_VENV)/bin/pip install -q "nemo-toolkit[core,common-only]==3.0.0"
	$(NEMO_VENV)/bin/pip install -q --no-deps -e .
	$(call repo_on_path,$(NEMO_VENV)/bin/python)
	$(NEMO_VENV)/bin/pip install -q --no-deps "nvidia-resiliency-ext>=0.4"
	$(NEMO_VENV)/bin/pip install -q defusedxml nvidia-ml-py psutil pynvml "zstandard>=0.22" "xxhash>=3.0" \
		"fsspec>=2023.1" "hydra-core>=1.3" "omegaconf>=2.3" "rich>=13" pytest pytest-timeout
	$(NEMO_VENV)/bin/python -c "import lightning; assert lightning.__version__.startswith('2.4'), lightning.__version__"
	touch $(NEMO_STAMP)

nemo-venv: $(NEMO_STAMP)

# the launch line of the README: `lightning-resilience launch` (torchrun underneath), a rank SIGKILLed, the restart
demo: $(STAMP)
	$(BIN)/python -m recipes.demo

# a longer launcher campaign than CI's: random fault sequences (SIGKILL, SIGTERM, exceptions) over 4 attempts each
LAUNCH_CAMPAIGN ?= 10
launch-drills: $(STAMP)
	LAUNCH_CAMPAIGN=$(LAUNCH_CAMPAIGN) LAUNCH_DRILLS=all $(BIN)/python -m pytest -q -p no:logging \
		tests/drills/test_launch.py tests/drills/test_readme_restarts.py

# the README's first example under plain `torchrun --max-restarts 2 --master-port P`: README_DRILLS kill drills in a row
README_DRILLS ?= 3
readme-drills: $(STAMP)
	README_DRILLS=$(README_DRILLS) $(BIN)/python -m pytest -q -p no:logging tests/drills/test_readme_restarts.py \
		-k plain_torchrun

# a one-node Slurm cluster on this machine for tests/slurm (installs slurm-wlm and munge with apt-get when missing;
# where it cannot, tests/slurm skip and say why)
slurm:
	bash .ci/slurm.sh

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

typecheck: $(STAMP)
	$(BIN)/mypy lightning_resilience recipes hydra_plugins

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck nemo-venv slurm unit

# every benchmark (about an hour and a half on 2 quiet cores), then docs/benchmarks.md and the README figures from the results
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# on a machine with a CUDA device (install a CUDA torch: make venv TORCH_SPEC="torch==2.13.0 --index-url ..."):
# sync-debug tests, the 1B-parameter bf16 step-time slowdown, pinned-memory overlap, NCCL drills with 2 GPUs
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check
	$(BIN)/python -m benchmarks.run_all --docs-only

clean:
	rm -rf $(VENV) build *.egg-info

# Every fault drill of the user's path (plain DataLoader, default preset, torchrun), plus DRILL_N random ones drawn
# from DRILL_SEED; CI runs a bounded subset of tests/drills/test_data_drills.py.
DRILL_N ?= 0
drills-data: $(STAMP)
	LR_DRILLS=all DRILL_N=$(DRILL_N) $(BIN)/python -m pytest -q -s tests/drills/test_data_drills.py

# Every kill drill of the stateful loaders (torchdata's StatefulDataLoader shuffled or with the user's
# DistributedSampler, Hugging Face map-style and iterable datasets; workers 0 and 2), each against its own
# uninterrupted run (about 16 minutes); CI runs one of them.
drills-loaders: $(STAMP)
	LR_DRILLS=all $(BIN)/python -m pytest -q -s tests/drills/test_loader_drills.py

# The randomized fault campaign (docs/reliability.md): N torchrun drills of the user's path, each with a random fault
# (drill i from seed SEED + i; replay one with N=1 SEED=<its seed>), checked bitwise and for lost steps, corrupt
# loads, deadlines and leftover processes. FAULTS=kind,kind draws from those kinds only; PUBLISH=1 writes
# docs/results/drill_campaign_<SEED>.json and regenerates the table of docs/reliability.md from every published one.
# VARIANT=in-process runs the default preset with the RAM snapshot held in the process (the "before" of the
# before-and-after table, published beside a campaign of the default at the same commit and FAULTS).
N ?= 10
SEED ?= $(shell date +%Y%m%d)
FAULTS ?=
PUBLISH ?=
VARIANT ?=
drills: $(STAMP)
	$(BIN)/python -m tests.drills.campaign --n $(N) --seed $(SEED) $(if $(FAULTS),--faults $(FAULTS)) \
		$(if $(VARIANT),--variant $(VARIANT)) $(if $(PUBLISH),--publish)

# The five stall paths of docs/reliability.md, before and after: tests/checkpoint/stalls_093449b.py replays the
# scenarios of tests/checkpoint/test_stalls.py on commit 093449b (a temporary worktree; each must hang or fail
# there, under a 90 s deadline per scenario), then the tests run on this tree (each must pass). About 7 minutes.
STALLS_BEFORE := 093449b
stalls-before-after: $(STAMP)
	@old=$$(mktemp -d)/$(STALLS_BEFORE) && git worktree add --detach $$old $(STALLS_BEFORE) >/dev/null && \
	(cd $$old && PYTHONPATH=$$old PYTHONWARNINGS=ignore::FutureWarning \
		$(abspath $(BIN))/python $(CURDIR)/tests/checkpoint/stalls_093449b.py); \
	rc=$$?; git worktree remove --force $$old && rmdir $$(dirname $$old); exit $$rc
	$(BIN)/python -m pytest -q tests/checkpoint/test_stalls.py

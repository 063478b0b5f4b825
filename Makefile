# Set-up is part of every target: a fresh clone needs only `make run` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The lean CPU SGLang (real servers in the engine tests; ~1.4 GB): pinned packages installed with --no-deps.
SGLANG_STAMP := $(VENV)/.sglang-installed
$(SGLANG_STAMP): $(STAMP) rollout/engines/sglang-cpu-requirements.txt
	bash rollout/engines/install_sglang_cpu.sh $(BIN)/python
	touch $(SGLANG_STAMP)

.PHONY: install run recipe pretrain test test-slow lint
install: $(STAMP)

# The main job: the Colab-scale RL run on the embedded defaults (SFT warm start, asynchronous RL, held-out eval).
run: $(STAMP)
	$(BIN)/python experiments/rl_main.py --workdir=runs/rl_colab

# The report's RL recipe (levels 1-3, self-summary chains) in its best measured row: ~2 h on 2 idle cores.
recipe: $(STAMP)
	$(BIN)/python experiments/rl_main.py --config=experiments/configs/rl.py:recipe_best --workdir=runs/rl_recipe

# Colab-scale continued pretraining (the LM stages; not needed by `run`).
pretrain: $(STAMP)
	$(BIN)/python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab --workdir=runs/pretrain_colab

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -m slow

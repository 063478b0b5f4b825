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

.PHONY: install run colab pretrain test test-slow lint
install: $(STAMP)

# The main job: the report's RL recipe at Colab scale on the embedded defaults (rl.py:recipe_best: levels 1-3,
# self-summary chains; SFT warm start, asynchronous RL, the equal-time SFT control, held-out eval): ~1 h on 2 idle cores.
run: $(STAMP)
	$(BIN)/python experiments/rl_main.py --workdir=runs/rl

# The level-1 run (read, edit, finish): 10-20 min on 2 idle cores.
colab: $(STAMP)
	$(BIN)/python experiments/rl_main.py --config=experiments/configs/rl.py:colab --workdir=runs/rl_colab

# Colab-scale continued pretraining (the LM stages; not needed by `run`).
pretrain: $(STAMP)
	$(BIN)/python experiments/pretrain_main.py --config=experiments/configs/pretrain.py:colab --workdir=runs/pretrain_colab

lint: $(STAMP)
	$(BIN)/ruff check .

# Two workers, one per core, each taking whole files (a file's module-level servers and caches stay in one process).
TEST_WORKERS ?= 2
test: lint $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m slow

"""Agent harness demo: scripted oracle, no-op and a randomly initialised model on procedural tasks, in workspaces.

  python experiments/agent_main.py --config=experiments/configs/agent.py:colab

Expected (colab, ~1 min on 2 CPU cores, in bubblewrap sandboxes): the oracle solves 100% of tasks (reward 1.0 each),
the no-op policy 0%, and a randomly initialised MoE served by the embedded JAX engine (`model`) 0% with
malformed-call penalties; transcripts and reward breakdowns are printed. A validity check of the tasks and the
grader. Options: `level=1..4`, `n_tasks=`, `split=train|heldout`, `budget=` (tokens per segment; small values
exercise self-summarization: `level=4,budget=768` asks for a summary twice in an episode and the oracle still solves
16/16; at 640 its three segments run out before the last fix), `policies=oracle+noop+model+random` (`random`:
uniform random tokens, no model), `workspaces=sandbox|local` (isolated `sandboxes` workspaces, or plain directories).
"""
import ml_collections

from experiments.configs import common
from experiments.configs import model as model_configs

# Config keys and args users typed before a rename: the CLI names the new one (`experiments/cli.py`).
RENAMED_KEYS = {"backend": "workspaces"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = common.parse_arg(arg, renames=RENAMED_KEYS, colab=False, level=1, n_tasks=0, split="train", budget=0,
                         policies="oracle+noop+model", seed=0, workspaces="sandbox")
  c = ml_collections.ConfigDict()
  c.seed = arg.seed
  c.policies = tuple(arg.policies.split("+"))
  c.model = model_configs.get_config("tiny")   # shape of the randomly initialised `model` policy
  c.workspaces = arg.workspaces  # 'sandbox' (bubblewrap namespaces via `sandboxes`) or 'local' (no isolation)
  c.tasks = ml_collections.ConfigDict(dict(kind="procedural", levels=(arg.level,),
                                           n=arg.n_tasks or (16 if arg.colab else 64), split=arg.split, seed=arg.seed))
  c.tokenizer = ml_collections.ConfigDict(dict(dir="", train_tasks=200, fit=dict(vocab_size=1024)))
  # Mirrors rollout.harness.HarnessConfig (system_prompt names one of harness.SYSTEM_PROMPTS).
  c.harness = ml_collections.ConfigDict(dict(
    system_prompt="short" if arg.colab else "full", context_budget=arg.budget or (1024 if arg.colab else 4096),
    max_turn_tokens=256 if arg.colab else 512, observation_reserve=256 if arg.colab else 512, max_turns=16,
    max_segments=3, summary_max_tokens=128, seed=c.get_ref("seed"), sampling=dict(temperature=1.0),
    tools=dict(max_output_chars=600 if arg.colab else 2000),
    rewards=dict(length_weight=0.0, length_k=0.01, length_q=0.5, length_unit="tokens", todo_weight=0.05,
                 malformed_weight=0.05, repeat_weight=0.02, no_message_weight=0.05, lint_weight=0.02)))
  c.transcripts = 1
  return c

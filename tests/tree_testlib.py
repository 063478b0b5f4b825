"""Synthetic tree groups for the tree tests: leaf trajectory dicts (`Trajectory.to_dict()` layout) built from the
tokens of each node, so shared prefixes are shared by construction."""
from __future__ import annotations

import numpy as np

ENV = 48    # token ids >= ENV are environment tokens (gen_mask 0), the rest generated (the step tests: vocab 64)
PROMPT = (ENV + 1, ENV + 2, ENV + 3)


def segment(tokens, n_layers: int = 0, top_k: int = 2) -> dict:
  """One segment's arrays; logprobs and routing are functions of (token, position), as a deterministic engine's."""
  t = np.asarray(tokens, np.int32)
  gen = (t < ENV).astype(np.int8)
  pos = np.arange(len(t))
  routed = None
  if n_layers:
    routed = ((t[:, None, None] + pos[:, None, None] + np.arange(n_layers)[:, None] + np.arange(top_k)) % 8)
  return {"tokens_T": t, "gen_mask_T": gen, "logprobs_T": np.where(gen > 0, -3.9 - 0.1 * (t % 7), 0.0)
          .astype(np.float32), "versions_T": np.where(gen > 0, 0, -1).astype(np.int32),
          "turns_T": np.zeros(len(t), np.int32), "routed_TxNxK": None if routed is None else routed.astype(np.int32),
          "prompt_len": len(PROMPT), "turns": [], "ends_with_summary": False}


def tree_group(nodes: dict, rewards: dict, multiplicity: dict | None = None, n_layers: int = 0) -> list[dict]:
  """Leaf trajectories of a one-segment tree: `nodes[path]` lists the tokens of node `path` (a tuple), `rewards`
  maps each leaf path to its reward (in group order)."""
  out = []
  for path, r in rewards.items():
    toks, starts = list(PROMPT), []
    for k in range(1, len(path) + 1):
      starts.append([0, len(toks)])
      toks += list(nodes[path[:k]])
    out.append({"task_id": "t", "segments": [segment(toks, n_layers)], "reward": float(r), "metrics": {},
                "tree": {"path": list(path), "starts": starts,
                         "multiplicity": (multiplicity or {}).get(path, 1)}})
  return out


def flat_group(token_lists, rewards, n_layers: int = 0) -> list[dict]:
  """A flat group (no tree specs): one trajectory per token list, after the common prompt."""
  return [{"task_id": "t", "segments": [segment(list(PROMPT) + list(t), n_layers)], "reward": float(r),
           "metrics": {}} for t, r in zip(token_lists, rewards, strict=True)]

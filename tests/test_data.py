"""composer_jax/train/data.py: the packing contract, long examples, SFT masks, determinism, checkpointable state."""

import collections
import dataclasses
import json
import time

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from composer_jax.train import corpus as corpus_lib
from composer_jax.train import data as data_lib
from composer_jax.train import tokenizer as tokenizer_lib
from rollout import chat_format as cf


def _synthetic(lengths, seed=0):
  """Examples with distinct token values (so segments can be matched back) and random 0/1 loss masks."""
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):
    tokens = (1000 * (i + 1) + np.arange(n)).astype(np.int32)
    out.append({"tokens": tokens, "loss_mask": rng.integers(0, 2, n).astype(np.float32)})
  return out


def _segments(batch):
  """(tokens, loss_mask, positions) per packed segment, read back from a batch."""
  out = []
  for b in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][b]
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      out.append((batch["tokens"][b, idx], batch["loss_mask"][b, idx], batch["positions"][b, idx], idx))
  return out


def _check_row_contract(batch, cfg):
  B, L = cfg.batch_size, cfg.seq_len
  assert set(batch) == set(data_lib.BATCH_KEYS)
  for key in data_lib.BATCH_KEYS:
    want = np.float32 if key.endswith("mask") else np.int32
    assert batch[key].shape == (B, L) and batch[key].dtype == want, key
  for b in range(B):
    seg = batch["segment_ids"][b]
    n = int((seg > 0).sum())
    assert (seg[n:] == 0).all() and (batch["tokens"][b, n:] == 0).all(), "padding only at the end of a row"
    assert (batch["loss_mask"][b, n:] == 0).all()
    assert (np.diff(seg[:n]) >= 0).all() and (np.diff(seg[:n]) <= 1).all() and (n == 0 or seg[0] == 1)
  # Reference for targets / target_mask by explicit loops.
  for b in range(B):
    for t in range(L):
      ok = t + 1 < L and batch["segment_ids"][b, t] > 0 and batch["segment_ids"][b, t] == batch["segment_ids"][b, t + 1]
      assert batch["targets"][b, t] == (batch["tokens"][b, t + 1] if ok else 0)
      assert batch["target_mask"][b, t] == (batch["loss_mask"][b, t + 1] if ok else 0.0)
  for tokens, _, positions, idx in _segments(batch):
    assert (positions == np.arange(len(tokens))).all(), "positions restart at 0 in each segment"
    assert (np.diff(idx) == 1).all(), "a segment is contiguous"


def test_eval_pass_packs_every_example_once_unsplit():
  cfg = data_lib.DataConfig(seq_len=16, batch_size=3, num_packing_bins=4)
  examples = _synthetic([5, 16, 1 + 1, 9, 7, 3, 12, 4, 8, 2, 15, 6])
  batches = list(data_lib.packed_dataset(examples, cfg, train=False))
  for batch in batches:
    _check_row_contract(batch, cfg)
  got = sorted(tuple(t.tolist()) + tuple(m.tolist()) for t, m, _, _ in (s for b in batches for s in _segments(b)))
  want = sorted(tuple(e["tokens"].tolist()) + tuple(e["loss_mask"].tolist()) for e in examples)
  assert got == want, "each example appears exactly once, whole, with its own loss mask"
  again = list(data_lib.packed_dataset(examples, cfg, train=False))
  assert all((a[k] == b[k]).all() for a, b in zip(batches, again, strict=True) for k in a), "eval is deterministic"


def test_eval_last_batch_padded_with_empty_rows():
  cfg = data_lib.DataConfig(seq_len=8, batch_size=3)
  batches = list(data_lib.packed_dataset(_synthetic([8, 8, 8, 8]), cfg, train=False))  # One full row each.
  assert len(batches) == 2
  _check_row_contract(batches[1], cfg)
  assert (batches[1]["segment_ids"][0] == 1).all() and (batches[1]["segment_ids"][1:] == 0).all()


def test_targets_hand_computed():
  """One row by hand: examples [a0 a1 a2] and [b0 b1] in L=6 with one pad."""
  batch = {"tokens": np.array([[7, 8, 9, 4, 5, 0]]), "tokens_segment_ids": np.array([[1, 1, 1, 2, 2, 0]]),
           "tokens_positions": np.array([[0, 1, 2, 0, 1, 0]]), "loss_mask": np.array([[1, 0, 1, 1, 1, 0.0]])}
  out = data_lib.add_targets(batch)
  np.testing.assert_array_equal(out["targets"], [[8, 9, 0, 5, 0, 0]])
  np.testing.assert_array_equal(out["target_mask"], [[0, 1, 0, 1, 0, 0]])


@pytest.mark.parametrize("n, L", [(10, 10), (11, 10), (19, 10), (20, 10), (37, 4), (2, 2), (5, 2)])
def test_chunk_example_covers_each_transition_once(n, L):
  ex = _synthetic([n])[0]
  chunks = data_lib.chunk_example(ex, L)
  assert all(2 <= len(c["tokens"]) <= L for c in chunks) or n <= L
  transitions = [(int(a), int(b)) for c in chunks for a, b in zip(c["tokens"][:-1], c["tokens"][1:])]
  want = [(int(a), int(b)) for a, b in zip(ex["tokens"][:-1], ex["tokens"][1:])]
  assert transitions == want
  # Target-side loss mask is preserved per transition too.
  masks = [float(m) for c in chunks for m in c["loss_mask"][1:]]
  assert masks == [float(m) for m in ex["loss_mask"][1:]]


def test_long_example_policy():
  examples = _synthetic([30, 5, 1])
  split, stats = data_lib.chunk_examples(examples, data_lib.DataConfig(seq_len=8))
  assert stats["split"] == 1 and stats["empty"] == 1 and len(split) == 5 + 1  # ceil(29 / 7) chunks + the short one.
  dropped, stats = data_lib.chunk_examples(examples, data_lib.DataConfig(seq_len=8, split_long_examples=False))
  assert stats["dropped_long"] == 1 and len(dropped) == 1
  with pytest.raises(ValueError, match="longer than seq_len=8"):
    data_lib.packed_dataset(examples, data_lib.DataConfig(seq_len=8), train=True)


def test_train_is_infinite_seeded_and_shuffled():
  examples = _synthetic(list(range(3, 14)))
  cfg = data_lib.DataConfig(seq_len=16, batch_size=2, num_packing_bins=3, seed=1)
  take = lambda c, n: [next(it) for it in [iter(data_lib.packed_dataset(examples, c, train=True))] for _ in range(n)]
  a, b = take(cfg, 30), take(cfg, 30)  # 30 batches = several epochs of 11 examples.
  assert all((x[k] == y[k]).all() for x, y in zip(a, b) for k in x)
  for batch in a[:5]:
    _check_row_contract(batch, cfg)
  c = take(data_lib.DataConfig(seq_len=16, batch_size=2, num_packing_bins=3, seed=2), 30)
  assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, c)), "another seed, another order"
  first_tokens = collections.Counter(int(t[0]) for batch in a for t, *_ in _segments(batch))
  assert set(first_tokens) == {1000 * (i + 1) for i in range(11)}, "every example comes around again"


def test_shards_are_disjoint_and_complete():
  examples = _synthetic([4, 5, 6, 7, 3])
  seen = []
  for i in range(2):
    cfg = data_lib.DataConfig(seq_len=8, batch_size=2, shard_index=i, shard_count=2)
    seen += [int(t[0]) for b in data_lib.packed_dataset(examples, cfg, train=False) for t, *_ in _segments(b)]
  assert sorted(seen) == [1000 * (i + 1) for i in range(5)]
  with pytest.raises(ValueError, match="shard_index"):
    data_lib.DataConfig(shard_index=2, shard_count=2)


def _same(a, b):
  return all((x[k] == y[k]).all() for x, y in zip(a, b, strict=True) for k in x)


def test_iterator_state_round_trip():
  examples = _synthetic(list(range(3, 17)))
  ds = data_lib.packed_dataset(examples, data_lib.DataConfig(seq_len=16, batch_size=2, num_packing_bins=3), True)
  it = iter(ds)
  for _ in range(7):
    next(it)
  state = it.get_state()
  want = [next(it) for _ in range(12)]
  fresh = iter(ds)
  fresh.set_state(json.loads(json.dumps(state)))  # The state survives serialisation.
  assert _same([next(fresh) for _ in range(12)], want)


def test_iterator_checkpoint_through_orbax(tmp_path):
  examples = _synthetic(list(range(3, 17)))
  ds = data_lib.packed_dataset(examples, data_lib.DataConfig(seq_len=16, batch_size=2, num_packing_bins=3), True)
  it = iter(ds)
  for _ in range(5):
    next(it)
  with ocp.CheckpointManager(str(tmp_path)) as mngr:
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  want = [next(it) for _ in range(8)]
  restored = iter(ds)
  with ocp.CheckpointManager(str(tmp_path)) as mngr:
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  assert _same([next(restored) for _ in range(8)], want)


@pytest.fixture(scope="module")
def tok():
  texts = ["def f(x):\n    return x + 1\n" * 30, "hello world, read the file please\n" * 10]
  return tokenizer_lib.train_tokenizer(texts, tokenizer_lib.TokenizerConfig(vocab_size=400))


def test_pretrain_examples_wrap_documents(tok):
  docs = ["x = '<|end_of_text|>'\n", "def g():\n\tpass\n"]
  for doc, ex in zip(docs, data_lib.pretrain_examples(tok, docs), strict=True):
    ids = ex["tokens"].tolist()
    assert ids[0] == cf.special_id(tok, cf.BEGIN_OF_TEXT) and ids[-1] == cf.special_id(tok, cf.END_OF_TEXT)
    assert tok.decode(ids[1:-1], skip_special_tokens=False) == doc
    assert not set(ids[1:-1]) & set(range(len(cf.SPECIAL_TOKENS)))
    assert (ex["loss_mask"] == 1).all()


def test_sft_pipeline_masks_only_model_tokens(tok, tmp_path):
  transcripts = [
    [{"role": "user", "content": "read the file"},
     {"role": "assistant", "content": "ok", "tool_calls": [{"name": "read", "arguments": {"p": "a"}}]},
     {"role": "tool", "content": "def f(x): return x"}, {"role": "assistant", "content": "done"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hello world"}],
    [{"role": "user", "content": "no reply"}],  # Nothing the model wrote: skipped.
  ]
  path = tmp_path / "sft.jsonl"
  path.write_text("\n".join(json.dumps({"messages": m}) for m in transcripts) + "\n\n")
  cfg = data_lib.DataConfig(seq_len=96, batch_size=2, num_packing_bins=2)
  data = data_lib.sft_data(tok, str(path), str(path), cfg)
  assert data.stats["eval"]["empty"] == 1
  batches = list(data.eval)
  for batch in batches:
    _check_row_contract(batch, cfg)
  segments = [s for b in batches for s in _segments(b)]
  want = {tuple(cf.encode_messages(tok, m)[0]): cf.encode_messages(tok, m)[1] for m in transcripts[:2]}
  assert len(segments) == 2
  for tokens, loss_mask, _, _ in segments:
    assert loss_mask.tolist() == want[tuple(tokens.tolist())]
  # The trained targets decode to exactly the model-written text.
  b = batches[0]
  trained = b["targets"][b["target_mask"] > 0]
  text = tok.decode(trained.tolist(), skip_special_tokens=False)
  for piece in ["ok", '{"name": "read"', "done", "hello world", cf.END_OF_TURN]:
    assert piece in text
  for piece in ["read the file", "def f", "be brief", cf.USER, cf.TOOL_RESULT]:
    assert piece not in text


@pytest.mark.parametrize("line, needle", [
  ("{not json", "sft.jsonl:2: not valid JSON"),
  ('{"messages": []}', 'sft.jsonl:2: expected an object with a non-empty "messages"'),
  ('{"messages": [{"role": "bot", "content": "x"}]}', "sft.jsonl:2: message 0 has role 'bot'"),
])
def test_read_transcripts_errors(tmp_path, line, needle):
  path = tmp_path / "sft.jsonl"
  path.write_text('{"messages": [{"role": "user", "content": "x"}]}\n' + line + "\n")
  with pytest.raises(ValueError, match=needle):
    data_lib.read_transcripts(str(path))


def test_pretrain_data_end_to_end(tmp_path):
  """stdlib corpus → trained tokenizer → batches; a second call reuses the saved tokenizer."""
  corpus_cfg = corpus_lib.CorpusConfig(max_total_bytes=200_000, heldout_fraction=0.1)
  cfg = data_lib.DataConfig(seq_len=128, batch_size=4)
  tok_dir = str(tmp_path / "tok")
  t0 = time.perf_counter()
  data = data_lib.pretrain_data(corpus_cfg, tokenizer_lib.TokenizerConfig(vocab_size=512), cfg, tok_dir)
  batch = next(iter(data.train))
  elapsed = time.perf_counter() - t0
  _check_row_contract(batch, cfg)
  assert (batch["segment_ids"] > 0).mean() > 0.9, "packing leaves little padding"
  assert elapsed < 60, f"first batch took {elapsed:.1f}s"  # ~2 s here; a generous bound for a loaded machine.
  again = data_lib.pretrain_data(corpus_cfg, tokenizer_lib.TokenizerConfig(vocab_size=999), cfg, tok_dir)
  assert again.tokenizer.get_vocab_size() == 512, "the saved tokenizer is reused (resume keeps token ids)"
  assert _same([next(iter(again.train))], [batch])
  eval_tokens = sum(int((b["segment_ids"] > 0).sum()) for b in data.eval)
  assert eval_tokens == data.stats["eval"]["tokens"]
  no_eval = data_lib.pretrain_data(dataclasses.replace(corpus_cfg, heldout_fraction=0.0),
                                   tokenizer_lib.TokenizerConfig(), cfg, tok_dir)
  assert no_eval.eval is None and no_eval.stats["corpus"]["heldout_files"] == 0

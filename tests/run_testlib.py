"""A stand-in for an RL run's shared pieces (`composer_jax.rl.setup.open_run`), for tests of what runs around them:
no task is loaded and no tokenizer fitted."""
import contextlib
import types

from composer_jax.rl import setup


def fake_run(monkeypatch, *, pool=(), heldout=(), tokenizer=None, envs=None) -> setup.Run:
  """Makes `setup.open_run` yield a `Run` of these pieces (`heldout` is read at each open, so a test may change it
  between runs; the workdir, the bar and the rules are the config's, the mesh the caller's); its workspaces'
  `factory.close()` is called when the block ends, as the real one's is."""
  envs = envs if envs is not None else types.SimpleNamespace(factory=types.SimpleNamespace(close=lambda: None))
  run = setup.Run(tokenizer, list(pool), list(heldout), [], envs, "", False, None, None)

  @contextlib.contextmanager
  def open_run(cfg, mesh=None):
    run.heldout, run.workdir, run.progress_bar = list(heldout), cfg.workdir, cfg.progress_bar
    run.mesh, run.rules = mesh, cfg.mesh.rules()
    try:
      yield run
    finally:
      envs.factory.close()

  monkeypatch.setattr(setup, "open_run", open_run)
  return run

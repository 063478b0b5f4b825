"""Counting compiles: `with lowerings() as n: f(x)` then `n.count` is how many programs JAX lowered meanwhile.

A lowering (jaxpr → MLIR) happens for every jit cache miss that really builds a program, whether XLA then compiles
it or finds it in the persistent compilation cache (which the tests turn on), so it is the count that says "this
call recompiled". A call that hits jit's cache lowers nothing.
"""
import contextlib
import dataclasses

import jax

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_total = [0]


def _listen(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  if event == _LOWERING_EVENT:
    _total[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


@dataclasses.dataclass
class Count:
  count: int = 0


@contextlib.contextmanager
def lowerings():
  n, start = Count(), _total[0]
  try:
    yield n
  finally:
    n.count = _total[0] - start

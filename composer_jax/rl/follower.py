"""The worker side of a publisher (`rl/publishers.py`, `rl/fleet.py`): an engine and how it keeps up."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Follower:
  """A worker's engine and how it keeps up: `version()` it now serves, `load_newer()` before each group."""
  engine: object
  version: Callable[[], int]
  load_newer: Callable[[], None] = lambda: None

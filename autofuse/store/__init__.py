"""The autofuse plan store: runs, candidates, trials and plans in SQL.

Imports nothing from JAX. See :class:`PlanStore`.
"""

from autofuse.store.db import StoreError
from autofuse.store.results import LookupResult
from autofuse.store.store import PlanStore

__all__ = ["LookupResult", "PlanStore", "StoreError"]

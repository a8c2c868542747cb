"""The untrusted inference worker (``intellect worker``): its loop, its rollouts, its client of the
submission service, its weight downloads. It never imports the trainer, the service's validator, the
ledger, DuckDB or Prefect (tests/unit/test_import_contract.py)."""

"""The control plane's database: ORM models (:mod:`.models`), engines and transactions
(:mod:`.session`) and migrations (:mod:`.migrate`, over the repository's ``migrations/``).

Only :mod:`controlplane.db.store` uses this package; ORM rows never leave it (docs/service.md).
"""

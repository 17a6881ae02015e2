"""``python -m provisioners.worker``: run the worker agent (:mod:`provisioners.worker.agent`)."""

from __future__ import annotations

from provisioners.worker.agent import main

if __name__ == "__main__":
    raise SystemExit(main())

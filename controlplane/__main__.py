"""``python -m controlplane`` is the ``heteroplane`` command."""

from controlplane.cli import main

raise SystemExit(main())

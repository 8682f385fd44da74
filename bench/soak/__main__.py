"""``python -m bench.soak``: the soak's command line (``bench.soak.cli``)."""

from bench.soak.cli import main

raise SystemExit(main())

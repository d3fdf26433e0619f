"""``python -m mila_py``: the ``mila-py`` command line."""

from __future__ import annotations

from mila_py.cli import main

raise SystemExit(main())

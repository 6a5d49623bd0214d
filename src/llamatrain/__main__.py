"""``python -m llamatrain`` is the same as the ``llamatrain`` command."""

from llamatrain.cli import main

raise SystemExit(main())

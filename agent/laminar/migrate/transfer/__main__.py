"""``python -m laminar.migrate.transfer``: :func:`laminar.migrate.transfer.cli.main`."""

import sys

from laminar.migrate.transfer.cli import main

sys.exit(main())

"""``python -m loraplex_cli``: the ``loraplex`` command."""

import sys

from loraplex_cli.main import main

sys.exit(main())

"""``python -m disagg``: the same as the installed ``disagg`` command."""

import sys

from disagg.main import main

sys.exit(main())

"""`python -m attn_core.cli`: the `attn-core` command."""

import sys

from attn_core.cli.main import main

sys.exit(main())

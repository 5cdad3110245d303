"""``python -m hf_tokred.cli``: the ``hf-tokred`` command."""

import sys

from hf_tokred.cli import main

sys.exit(main())

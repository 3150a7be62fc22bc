"""``python -m validation.results [--check]``: regenerate (or check) recipes/RESULTS.md from validation/results/."""

import sys

from validation.results import main

sys.exit(main())

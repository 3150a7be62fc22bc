"""``python -m validation.kernels``: the attention fit and every kernel row's error under the dgx-h100 profile."""

import sys

from validation.kernels import main

sys.exit(main())

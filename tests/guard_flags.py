"""Another module whose global is read by a forward in tests/guard_cases.py (the invalidation matrix).

As in real code, the flag is fixed at import from an environment variable: the cold and the
warm process of the matrix import it with different values.
"""

from __future__ import annotations

import os

USE_FAST_PATH = os.environ.get("GUARD_MATRIX_FLAG", "0") == "1"

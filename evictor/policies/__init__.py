"""The built-in eviction policies; importing this package registers all of them (`python -m evictor.policies`).

Modules are imported in listing order: score-free baselines, key/value geometry, EpiKV, attention-requiring.
"""

from evictor.policies import baselines  # noqa: F401, I001  (each module registers its policies on import)
from evictor.policies import geometry  # noqa: F401
from evictor.policies import epikv  # noqa: F401
from evictor.policies import attention  # noqa: F401
from evictor.policies import triattention  # noqa: F401
from evictor.policies import thinkv  # noqa: F401

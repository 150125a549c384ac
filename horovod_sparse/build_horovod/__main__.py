"""``python -m horovod_sparse.build_horovod``."""

import sys

from horovod_sparse.build_horovod import main

sys.exit(main())

"""`python -m proxy` is `tokenweir`."""

import sys

from proxy.entry import main

sys.exit(main())

import sys

from peer.cli.main import main

sys.exit(main())

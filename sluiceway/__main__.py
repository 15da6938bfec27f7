from sluiceway.server.cli import main

raise SystemExit(main())

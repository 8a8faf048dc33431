from rigup.cli import main

raise SystemExit(main())

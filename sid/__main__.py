from sid.entrypoints.cli import main

raise SystemExit(main())
